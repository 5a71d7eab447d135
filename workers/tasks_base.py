"""What every task of workers/tasks.py shares: the `Task` interface the trainer reads, the
ignore index of targets, and the check of a batch's arguments."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "Task", "check_batch_args"]

IGNORE_INDEX = -100
"""Target value meaning "no loss here" (the default ignore index of ``F.cross_entropy``)."""


class Task(Protocol):
    """What the trainer needs from a data source.

    ``known_optimum`` is the lowest achievable mean loss per target token when it is known
    (0.0 for the synthetic tasks, whose answers are determined by the input), else ``None``.
    """

    vocab_size: int
    seq_len: int
    known_optimum: float | None

    def train_batch(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Draw one training batch ``(x, y)``, using only ``generator`` for randomness."""
        ...

    def valid_batches(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """Return the fixed validation set as ``(x, y)`` batches (same on every call).

        The tensors may be shared between calls, so callers must treat them as read-only.
        """
        ...

    def attention_targets(self, x: Tensor) -> Tensor | None:
        """For inputs ``x`` (B, T): per query, the key position that holds the answer it needs
        (-1 where a query has none), or None when the task has no answer key (language
        modelling). What `attention_target_mass` (docs/metrics.md section 7) measures."""
        ...


def check_batch_args(batch_size: int, generator: torch.Generator | None = None) -> None:
    """Fail early on arguments that would otherwise give confusing tensor errors."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU torch.Generator, got {generator.device}")
