"""Model runners: what trains the members in the engine's slots (workers/engine.py).

A runner knows tensors and nothing about members' lives: `PlainRunner` trains one ordinary
`GPT` with torch's optimizer (`run_trial`, and every one-slot worker);
`workers.fused.FusedRunner` trains M members stacked on a member axis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from workers.evaluation import penalty
from workers.member import Member
from workers.regularizers import z_loss

__all__ = ["ModelRunner", "PlainRunner", "StepOut", "unclipped_grad_norm"]


@dataclass
class StepOut:
    """One training step's per-slot results, on the device (no host sync): (M,) each."""

    loss: Tensor
    penalty: Tensor | None  # None when no member uses a regularizer
    grad_norm: Tensor
    bad: Tensor  # bool: this step's loss (or loss + penalty) was not finite


class ModelRunner(Protocol):
    """Trains the members in its slots; knows tensors, not members' lives."""

    capacity: int

    def place(self, members: Sequence[Member]) -> None:
        """Train these members from now on, in this slot order. Members already placed keep
        their state; newcomers start from their own `model` and `optimizer`."""

    def train_step(self, batches: Sequence[tuple[Tensor, Tensor]], healthy: Tensor) -> StepOut:
        """One update of every placed member (at its own `lr_factor`); `healthy` (M,) bool
        masks members that already went bad (a runner may freeze them)."""

    def sync(self, slot: int, member: Member) -> None:
        """Copy the slot's weights and optimizer state into `member.model`/`.optimizer`."""


def unclipped_grad_norm(params: Sequence[Tensor]) -> Tensor:
    """The total 2-norm of the gradients, which stay as they are (`optim.grad_clip: null`).

    The value `clip_grad_norm_` returns (the same kernels, so the same rounding), without its
    multiply: `clip_grad_norm_(params, inf)` is not "no clipping". Its coefficient is
    inf / (norm + 1e-6), and once the norm overflows float32 (a sum of squares past 3.4e38: a
    norm past 1.8e19, every gradient finite) that is inf / inf = nan, so every gradient
    became nan and the trial was recorded DIVERGED at the next step with a finite loss,
    while the same trial in float64, or fused (its norm rounds a little differently and did
    not overflow), trained on (issue 46).
    """
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, 2.0)


class PlainRunner:
    """One slot: an ordinary GPT with torch's optimizer (the run-alone reference)."""

    capacity = 1

    def __init__(self, ctx: AbstractContextManager[Any]) -> None:
        self.ctx = ctx
        self.member: Member | None = None
        self.forward: Callable[..., tuple[Tensor, Tensor | None]] | None = None

    def place(self, members: Sequence[Member]) -> None:
        if len(members) > 1:
            raise ValueError("a plain runner has one slot")
        mem = members[0] if members else None
        if mem is not self.member and mem is not None:
            model = mem.model
            self.forward = torch.compile(model) if mem.config.compile else model  # type: ignore[assignment]
            model.train()
        self.member = mem

    def train_step(self, batches: Sequence[tuple[Tensor, Tensor]], healthy: Tensor) -> StepOut:
        mem, fwd = self.member, self.forward
        assert mem is not None and fwd is not None
        (x, y), reg, opt = batches[0], mem.config.regularizer, mem.optimizer
        lr = mem.config.optim.lr * mem.lr_factor()
        for group in opt.param_groups:
            group["lr"] = lr
        with self.ctx:
            logits, loss = fwd(x, y)
            assert loss is not None
        total = loss
        z_coef = mem.config.z_loss_coef
        if z_coef != 0.0:  # outside autocast, in float32 (no term at all when 0)
            total = total + z_coef * z_loss(logits, y)
        pen = penalty(mem.model, reg) if reg.kind != "none" and reg.lam != 0.0 else None
        total = total if pen is None else total + reg.lam * pen
        bad = ~(torch.isfinite(loss.detach()) & torch.isfinite(total.detach()))
        opt.zero_grad(set_to_none=True)
        total.backward()  # type: ignore[no-untyped-call]
        clip = mem.config.optim.grad_clip
        params = list(mem.model.parameters())
        if clip is None:  # no clipping: the norm is measured, the gradients left as they are
            grad_norm = unclipped_grad_norm(params)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        return StepOut(
            loss.detach().view(1),
            None if pen is None else pen.detach().view(1),
            grad_norm.view(1),
            bad.view(1),
        )

    def sync(self, slot: int, member: Member) -> None:
        """Nothing to copy: the member's own model and optimizer are what trains."""
