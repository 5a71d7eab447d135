"""The synthetic tasks: ``associative_recall``, ``sort`` and ``copy``, each with a known
optimum of zero loss (the answer is determined by the input); workers/tasks.py describes what
every task guarantees."""

from __future__ import annotations

import torch
from torch import Tensor

from workers.config_sections import TaskConfig
from workers.tasks_base import IGNORE_INDEX, check_batch_args

__all__ = ["AssociativeRecallTask", "CopyTask", "SortTask"]

_VALID_SEED_OFFSET = 1_000_003
"""Offset added to the task seed for the synthetic validation generator (kept apart from any
training generator a caller might seed with the same ``seed``)."""


class _SyntheticTask:
    """Shared machinery: subclasses generate ``n`` examples from a generator.

    The validation set is ``n_valid`` examples generated once from a generator seeded with
    ``seed + 1_000_003``, then chunked by ``batch_size``, so its contents do not depend on the
    batch size used to evaluate it.
    """

    vocab_size: int
    seq_len: int
    known_optimum: float | None

    def __init__(self, config: TaskConfig, seed: int) -> None:
        """Record the layout; the validation set is generated lazily on first use."""
        self.seq_len = config.seq_len
        self.known_optimum = 0.0
        self.n_symbols = config.n_symbols
        self.n_valid = config.n_valid
        self.seed = seed
        self._valid: tuple[Tensor, Tensor] | None = None
        self._valid_cache: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def _generate(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Return ``n`` examples as ``(x, y)`` of shape ``(n, seq_len)``."""
        raise NotImplementedError

    def train_batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Fresh random examples drawn only from ``generator``."""
        check_batch_args(batch_size, generator)
        return self._generate(batch_size, generator)

    def valid_batches(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """The fixed validation examples, chunked into batches of ``batch_size``."""
        check_batch_args(batch_size)
        if self._valid is None:
            gen = torch.Generator().manual_seed(self.seed + _VALID_SEED_OFFSET)
            self._valid = self._generate(self.n_valid, gen)
        cached = self._valid_cache.get(batch_size)
        if cached is None:
            x, y = self._valid
            cached = [
                (xb.contiguous(), yb.contiguous())
                for xb, yb in zip(
                    torch.split(x, batch_size), torch.split(y, batch_size), strict=True
                )
            ]
            self._valid_cache[batch_size] = cached
        return list(cached)

    def attention_targets(self, x: Tensor) -> Tensor | None:
        """No answer key unless a task defines one (associative recall does)."""
        return None

    def _left_pad(self, x: Tensor, y: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
        """Left-pad ``x`` with ``pad_id`` and ``y`` with the ignore index up to ``seq_len``."""
        n, length = x.shape
        pad = self.seq_len - length
        if pad == 0:
            return x, y
        x_out = torch.full((n, self.seq_len), pad_id, dtype=torch.int64)
        y_out = torch.full((n, self.seq_len), IGNORE_INDEX, dtype=torch.int64)
        x_out[:, pad:] = x
        y_out[:, pad:] = y
        return x_out, y_out


class AssociativeRecallTask(_SyntheticTask):
    """Key-value recall: ``k1 v1 k2 v2 ... kp vp Q k`` -> predict the value of ``k``.

    Ids: keys ``[0, n_symbols)``, values ``[n_symbols, 2 * n_symbols)``, the query marker
    ``2 * n_symbols`` and the pad token ``2 * n_symbols + 1``. Keys within an example are
    distinct, values are drawn independently. Only the last position carries a target (the
    queried key's value); examples are left-padded to ``seq_len``.
    """

    def __init__(self, config: TaskConfig, seed: int) -> None:
        """Set up the id layout described in the class docstring."""
        super().__init__(config, seed)
        self.n_pairs = config.n_pairs
        self.query_id = 2 * self.n_symbols
        self.pad_id = 2 * self.n_symbols + 1
        self.vocab_size = 2 * self.n_symbols + 2

    def _generate(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Sample distinct keys, random values and a queried pair for ``n`` examples."""
        p = self.n_pairs
        scores = torch.rand((n, self.n_symbols), generator=generator)
        keys = scores.argsort(dim=1, stable=True)[:, :p]
        values = torch.randint(0, self.n_symbols, (n, p), generator=generator, dtype=torch.int64)
        which = torch.randint(0, p, (n, 1), generator=generator, dtype=torch.int64)
        pairs = torch.stack((keys, values + self.n_symbols), dim=2).reshape(n, 2 * p)
        query = torch.full((n, 1), self.query_id, dtype=torch.int64)
        x = torch.cat((pairs, query, keys.gather(1, which)), dim=1)
        y = torch.full_like(x, IGNORE_INDEX)
        y[:, -1] = values.gather(1, which)[:, 0] + self.n_symbols
        return self._left_pad(x, y, self.pad_id)

    def attention_targets(self, x: Tensor) -> Tensor:
        """The answer's position for the query at the last position: the value right after the
        queried key's earlier occurrence (keys of an example are distinct, and a value, the
        query marker or a pad never equals a key); -1 for every other query."""
        n, t = x.shape
        match = x[:, : t - 2] == x[:, t - 1 :]  # (n, t - 2): the queried key's occurrence
        if not bool((match.sum(dim=1) == 1).all()):
            raise ValueError("not associative-recall inputs: the queried key must occur once")
        out = torch.full((n, t), -1, dtype=torch.int64)
        out[:, -1] = match.to(torch.int64).argmax(dim=1) + 1
        return out


class _SeqToSeqTask(_SyntheticTask):
    """``a_1 .. a_L SEP b_1 .. b_L`` with teacher-forced targets on the ``b`` part.

    ``L = (seq_len - 1) // 2``. Ids: symbols ``[0, n_symbols)``, separator ``n_symbols``, pad
    ``n_symbols + 1``. ``x`` holds the whole sequence (left-padded to ``seq_len``); ``y[t]`` is
    ``x[t + 1]`` from the separator up to the second-to-last ``b``, ignore elsewhere, so every
    ``b_i`` is predicted exactly once.
    """

    def __init__(self, config: TaskConfig, seed: int) -> None:
        """Set up the id layout described in the class docstring."""
        super().__init__(config, seed)
        self.length = (self.seq_len - 1) // 2
        self.sep_id = self.n_symbols
        self.pad_id = self.n_symbols + 1
        self.vocab_size = self.n_symbols + 2

    def _answer(self, source: Tensor) -> Tensor:
        """The target sequence for each row of ``source``."""
        raise NotImplementedError

    def _generate(self, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Sample ``n`` source sequences (with repetition) and lay out source, SEP, answer."""
        big_l = self.length
        source = torch.randint(
            0, self.n_symbols, (n, big_l), generator=generator, dtype=torch.int64
        )
        sep = torch.full((n, 1), self.sep_id, dtype=torch.int64)
        x = torch.cat((source, sep, self._answer(source)), dim=1)  # (n, 2L + 1)
        y = torch.full_like(x, IGNORE_INDEX)
        y[:, big_l : 2 * big_l] = x[:, big_l + 1 :]
        return self._left_pad(x, y, self.pad_id)


class SortTask(_SeqToSeqTask):
    """Sorting (Dong et al.): the answer is the source sorted ascending by symbol id."""

    def _answer(self, source: Tensor) -> Tensor:
        """Sort each row ascending."""
        return source.sort(dim=1, stable=True).values


class CopyTask(_SeqToSeqTask):
    """Copying: the answer is the source itself."""

    def _answer(self, source: Tensor) -> Tensor:
        """Return the source unchanged (a copy, so the layout owns its memory)."""
        return source.clone()
