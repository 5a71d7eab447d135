"""The language-modelling task (`lm`): next-token prediction on ``<data_dir>/<split>.txt``
files (e.g. WikiText-2), word or character level, the vocabulary from the training split only
(workers/tasks.py describes what every task guarantees); or on the data forms of
docs/your-data.md (bytes, a trained BPE or a tokenizer file; `.bin` token files; a local
dataset), loaded by workers/data/corpus.py."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from workers.config_sections import TaskConfig
from workers.data.corpus import clear_token_cache, load_token_corpus, source_stats, split_texts
from workers.tasks_base import check_batch_args

__all__ = [
    "EOS_TOKEN",
    "MAX_VALID_BATCHES",
    "UNK_TOKEN",
    "DataOutsideRoot",
    "LMTask",
    "check_data_root",
    "clear_corpus_cache",
]

UNK_TOKEN = "<unk>"
"""Language-modelling token for anything outside the vocabulary; always id 0."""

EOS_TOKEN = "<eos>"
"""Word-level token appended at the end of every line of text."""

MAX_VALID_BATCHES = 64
"""Upper bound on the number of language-modelling validation batches, to bound eval cost."""


@dataclass(frozen=True)
class _Corpus:
    """A tokenized, encoded train/valid pair; shared between tasks via the module cache."""

    vocab: tuple[str, ...]
    train_ids: Tensor
    valid_ids: Tensor


_CorpusKey = tuple[str, str, str, str, int, int | None, tuple[tuple[int, int], ...]]
_CORPUS_CACHE: dict[_CorpusKey, _Corpus] = {}
_CORPUS_LOCK = threading.Lock()


def clear_corpus_cache() -> None:
    """Drop every cached corpus (frees memory; the next ``lm`` task re-reads its files)."""
    with _CORPUS_LOCK:
        _CORPUS_CACHE.clear()
    clear_token_cache()


def _tokenize(text: str, tokenizer: Literal["word", "char"], limit: int | None) -> list[str]:
    """Split ``text`` into tokens, stopping once ``limit`` tokens (if given) are collected.

    Word level: whitespace-separated words, with :data:`EOS_TOKEN` after every line (a final
    line without a trailing newline still gets one). Char level: every character, newlines
    included.
    """
    if tokenizer == "char":
        chars = list(text)
        return chars if limit is None else chars[:limit]
    lines = text.split("\n")
    if text.endswith("\n") or text == "":
        lines.pop()  # the empty string after the final newline is not a line
    tokens: list[str] = []
    for line in lines:
        tokens.extend(line.split())
        tokens.append(EOS_TOKEN)
        if limit is not None and len(tokens) >= limit:
            break
    return tokens if limit is None else tokens[:limit]


def _build_vocab(tokens: list[str], cap: int) -> tuple[str, ...]:
    """``<unk>`` at id 0, then the ``cap`` most frequent tokens (ties: by token string).

    A literal ``<unk>`` in the text (WikiText has many) is the same token as the fallback, so
    it is not counted as a separate vocabulary entry.
    """
    counts = Counter(tokens)
    counts.pop(UNK_TOKEN, None)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:cap]
    return (UNK_TOKEN, *(tok for tok, _ in ranked))


def _encode(tokens: list[str], stoi: dict[str, int]) -> Tensor:
    """Map tokens to a 1-D int64 id tensor; unknown tokens become id 0 (``<unk>``)."""
    return torch.tensor([stoi.get(tok, 0) for tok in tokens], dtype=torch.int64)


def _read_split(path: Path) -> str:
    """Read one split as UTF-8 text, with a clear error naming a missing file."""
    if not path.is_file():
        raise FileNotFoundError(f"lm data file not found: {path}")
    return path.read_text(encoding="utf-8")


class DataOutsideRoot(ValueError):
    """A trial's data resolves outside the data directory it was allowed."""


def check_data_root(config: TaskConfig) -> None:
    """With `task.data_root` (set by the service), `data_dir` and every file the task reads
    (`source_stats`: the text splits, the `.bin` files, a dataset's files, a tokenizer file)
    resolve inside it; raises `DataOutsideRoot` otherwise. Called before anything is read."""
    if config.data_root is None or config.data_dir is None:
        return
    data_dir = Path(config.data_dir).expanduser().resolve()
    files = [Path(p).resolve() for p, _, _ in source_stats(config, data_dir)]
    _check_inside(config, config.data_root, (data_dir, *files))


def _check_inside(config: TaskConfig, root: str, paths: tuple[Path, ...]) -> None:
    """Every path (resolved: symlinks followed) inside `root` (resolved too). The service
    checked `data_dir` at the POST, but a directory absent then can be a symlink out of the
    root by the time a trial opens it: checked again here, where the files are read. The
    error names the data_dir as the study gave it, never where it leads."""
    base = Path(root).expanduser().resolve()
    given = Path(str(config.data_dir))
    if given.is_relative_to(root):  # the runner joined the study's path to the root
        given = given.relative_to(root)
    for path in paths:
        if path != base and base not in path.parents:
            raise DataOutsideRoot(
                f"task.data_dir {str(given)!r} (or one of its split files) resolves "
                "outside the data directory (QKSCOPE_DATA_DIR): refused; it must stay inside "
                "it, symlinks included"
            )


def _load_corpus(config: TaskConfig) -> _Corpus:
    """Load, tokenize and encode the train/valid splits, memoized per process.

    The cache key includes each file's modification time and size so an edited file is not
    served stale from the cache. The splits are `<split>.txt`, or with `format: dataset` the
    text of a dataset's rows (workers/data/corpus.py).
    """
    assert config.data_dir is not None  # guaranteed by TaskConfig validation
    data_dir = Path(config.data_dir).expanduser().resolve()
    if config.format == "dataset":
        stats: list[tuple[int, int]] = [st[1:] for st in source_stats(config, data_dir)]
    else:
        train_path = data_dir / f"{config.train_split}.txt"
        valid_path = data_dir / f"{config.valid_split}.txt"
        stats = []
        for path in (train_path, valid_path):
            if not path.is_file():
                raise FileNotFoundError(f"lm data file not found: {path}")
            st = path.stat()
            stats.append((st.st_mtime_ns, st.st_size))
    key: _CorpusKey = (
        str(data_dir) if config.format == "text" else f"{data_dir}:{config.text_column}",
        config.train_split,
        config.valid_split,
        config.tokenizer,
        config.vocab_cap,
        config.max_train_tokens,
        tuple(stats),
    )
    with _CORPUS_LOCK:
        cached = _CORPUS_CACHE.get(key)
        if cached is not None:
            return cached
        if config.format == "dataset":
            train_text, valid_text = split_texts(config, data_dir)
        else:
            train_text, valid_text = _read_split(train_path), _read_split(valid_path)
        level: Literal["word", "char"] = "char" if config.tokenizer == "char" else "word"
        train_tokens = _tokenize(train_text, level, config.max_train_tokens)
        valid_tokens = _tokenize(valid_text, level, None)
        vocab = _build_vocab(train_tokens, config.vocab_cap)
        stoi = {tok: i for i, tok in enumerate(vocab)}
        corpus = _Corpus(
            vocab=vocab,
            train_ids=_encode(train_tokens, stoi),
            valid_ids=_encode(valid_tokens, stoi),
        )
        _CORPUS_CACHE[key] = corpus
        return corpus


class LMTask:
    """Next-token prediction on a text corpus.

    Training windows start at uniformly random offsets of the training split; validation is
    the leading consecutive non-overlapping windows of the validation split, at most
    :data:`MAX_VALID_BATCHES` batches (the last batch may be smaller than ``batch_size``).
    """

    def __init__(self, config: TaskConfig) -> None:
        """Load (or fetch from the cache) the corpus named by ``config``.

        Word and char (on text or a dataset) hold both splits as int64 tensors and their
        vocabulary's tokens (`vocab`); the other forms hold them as unsigned numpy arrays
        (memory-mapped from `.bin` files and the token cache), `vocab` empty and the
        `tokenizers.Tokenizer` of bpe and file in `tokenizer`. Data that resolves outside the
        service's data root is refused first (`check_data_root`).
        """
        check_data_root(config)
        self.seq_len: int = config.seq_len
        self.known_optimum: float | None = None
        self.tokenizer: Any = None
        self.train_ids: Tensor | np.ndarray
        self.valid_ids: Tensor | np.ndarray
        if config.format != "bin" and config.tokenizer in ("word", "char"):
            corpus = _load_corpus(config)
            self.vocab: tuple[str, ...] = corpus.vocab
            self.vocab_size: int = len(corpus.vocab)
            self.train_ids, self.valid_ids = corpus.train_ids, corpus.valid_ids
        else:
            tokens = load_token_corpus(config)
            self.vocab, self.vocab_size = (), tokens.vocab_size
            self.train_ids, self.valid_ids = tokens.train_ids, tokens.valid_ids
            self.tokenizer = tokens.tokenizer
        for split, ids in (
            (config.train_split, self.train_ids),
            (config.valid_split, self.valid_ids),
        ):
            if len(ids) < self.seq_len + 1:
                raise ValueError(
                    f"split {split!r} has {len(ids)} tokens, fewer than seq_len + 1 = "
                    f"{self.seq_len + 1}"
                )
        self._offsets = torch.arange(self.seq_len + 1, dtype=torch.int64)
        self._valid_cache: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def attention_targets(self, x: Tensor) -> Tensor | None:
        """Language modelling has no answer key."""
        return None

    def _windows(self, ids: Tensor | np.ndarray, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Gather ``ids[s : s + T + 1]`` for each start and split it into inputs and targets
        (int64; from a numpy array only the windows are read and widened)."""
        index = starts[:, None] + self._offsets[None, :]
        if isinstance(ids, np.ndarray):
            w = torch.from_numpy(ids[index.numpy()].astype(np.int64))
        else:
            w = ids[index]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def train_batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Random windows of the training split: ``y`` is ``x`` shifted by one token."""
        check_batch_args(batch_size, generator)
        high = len(self.train_ids) - self.seq_len  # last valid start is n - T - 1
        starts = torch.randint(0, high, (batch_size,), generator=generator, dtype=torch.int64)
        return self._windows(self.train_ids, starts)

    def valid_batches(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """Consecutive non-overlapping windows from the start of the validation split."""
        check_batch_args(batch_size)
        cached = self._valid_cache.get(batch_size)
        if cached is None:
            n_windows = (len(self.valid_ids) - 1) // self.seq_len
            n_windows = min(n_windows, MAX_VALID_BATCHES * batch_size)
            starts = torch.arange(n_windows, dtype=torch.int64) * self.seq_len
            cached = [
                self._windows(self.valid_ids, chunk) for chunk in torch.split(starts, batch_size)
            ]
            self._valid_cache[batch_size] = cached
        return list(cached)
