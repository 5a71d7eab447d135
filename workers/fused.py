"""Fused trials: M trials of one architecture trained together as one `FusedGPT`.

`FusedRunner` is the trial engine's model runner for M slots (workers/engine.py): the engine
admits members, steps them and finishes each alone; this module only knows tensors. Each
member keeps everything that makes it its own trial: hyperparameters (learning rate, weight
decay, betas, gradient clip, regularizer kind/lambda/target mean, QK init scale, attention
temperature), seed (and so its init, its data order and, for synthetic tasks, its validation
set), its step in its own schedule, loss, probes, metrics, reports, checkpoint and summary.

The contract is equality: on CPU in float32, a member's evaluation losses match the same
config run alone by `run_trial` (within 1e-4 relative at quickstart sizes; float rounding of
batched vs single matmuls is the only difference, and every per-member scalar is computed in
float64 as torch computes its Python floats, so in float64 a member matches alone to 1e-8 or
better). Large `qk_init_std` (>= ~0.2) makes a trial chaotic: it amplifies float32 rounding
to ~1e-2 by a few hundred steps, so there fused and alone part by as much as the same trial
with 1e-7 noise on its initial weights (bench/README.md, "fused: equality").

Slots change by re-stacking: when a member leaves or joins, every member's weights and
optimizer state are copied out to its own GPT and torch optimizer (the checkpoint format) and
the stack is rebuilt from them. Copies are exact, so a member that joins mid-run, or resumes
in another slot, trains exactly as it would alone, and a stopped member costs no compute.

A member with lambda 0 (or regularizer none) gets no penalty term at all, not `0 * penalty`:
a penalty that overflows for its weights cannot turn its loss into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from workers.config import RegularizerKind, TrialConfig, TrialSummary
from workers.engine import Engine
from workers.fused_model import FusedGPT
from workers.fusion_plan import (
    FusionError,
    check_fusable,
    fusion_key,
    group_by_key,
)
from workers.member import Member, Reporter, autocast_for, new_member
from workers.member import resolve_device as resolve_device
from workers.model import GPT
from workers.models import QKModel
from workers.runners import StepOut
from workers.stopping import StopRule

__all__ = [
    "FusedRunner",
    "FusionError",
    "check_fusable",
    "fusion_key",
    "group_by_key",
    "run_trial_group",
]


# --------------------------------------------------------------------------------------------
# Per-member optimiser state, batched over the member axis
# --------------------------------------------------------------------------------------------


def _per_member(values: Sequence[float], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _hyper(values: Sequence[float], device: torch.device) -> Tensor:
    """Per-member optimiser scalars in float64, the precision of torch's Python-float math.

    torch.optim computes lr, 1 - beta, bias corrections and step sizes as Python floats
    (double) and rounds each once to the parameter dtype inside the kernel. Computing them in
    float32 instead (float32(0.999) ** step, then 1 - it) is off by up to ~1e-5 relative in
    the early bias corrections: 100x float32 rounding, enough to push a chaotic trial
    (large qk_init_std) off its run-alone trajectory. So: float64 here, cast at use.
    """
    return torch.tensor(values, dtype=torch.float64, device=device)


def _view(v: Tensor, like: Tensor) -> Tensor:
    """An (M,) tensor viewed to broadcast against an (M, ...) tensor."""
    return v.view((-1,) + (1,) * (like.dim() - 1))


def _bcast(v: Tensor, like: Tensor) -> Tensor:
    """An (M,) scalar tensor rounded to `like`'s dtype, viewed to broadcast against it."""
    return _view(v.to(like.dtype), like)


class _BatchedOptimizer:
    """AdamW or SGD (no momentum) with per-member lr, weight decay and betas.

    Follows torch.optim.AdamW's foreach update (capturable=False) literally, scalars included:
    every per-member scalar (lr, 1 - lr * wd, betas, step size, sqrt of the second bias
    correction) is computed in float64 and rounded once to the parameter dtype, as torch
    rounds its Python floats. An update is applied only to the members in `active` (a device
    bool mask); every other member's state stays as it is.
    """

    EPS = 1e-8

    def __init__(self, configs: Sequence[TrialConfig], params: list[Tensor], dev: torch.device):
        self.name = configs[0].optim.name
        self.params = params
        self.lr = _hyper([c.optim.lr for c in configs], dev)
        # torch's AdamW form (decay lr * wd): independent decay is wd / lr there
        # (OptimConfig.torch_weight_decay, config_sections.py)
        self.wd = _hyper([c.optim.torch_weight_decay for c in configs], dev)
        self.beta1 = _hyper([c.optim.beta1 for c in configs], dev)
        self.beta2 = _hyper([c.optim.beta2 for c in configs], dev)
        self.step_count = torch.zeros(len(configs), dtype=torch.float32, device=dev)
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]
        # which parameters have optimizer state (torch keeps none for one never updated)
        self.touched = [False] * len(params)

    @torch.no_grad()
    def step(self, factors: Tensor, active: Tensor) -> None:
        """One update at each member's own lr factor ((M,) float64: members may be at
        different steps of their schedules)."""
        lr = self.lr * factors
        if self.name == "sgd":
            for p in self.params:
                if p.grad is None:  # unused by this architecture: skipped, as torch does
                    continue
                g = p.grad + _bcast(self.wd, p) * p
                p.copy_(torch.where(_view(active, p), p - _bcast(lr, p) * g, p))
            return
        self.step_count = torch.where(active, self.step_count + 1, self.step_count)
        step = torch.clamp(self.step_count, min=1.0).to(torch.float64)
        step_size = lr / (1 - self.beta1**step)
        bc2_sqrt = torch.sqrt(1 - self.beta2**step)
        decay = 1 - lr * self.wd
        one_minus_b1, one_minus_b2 = 1 - self.beta1, 1 - self.beta2
        for i, (p, m, v) in enumerate(zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True)):
            if p.grad is None:  # unused by this architecture: skipped, as torch does
                continue
            self.touched[i] = True
            g, a = p.grad, _view(active, p)
            new_p = p * _bcast(decay, p)
            new_m = m.lerp(g, _bcast(one_minus_b1, p))
            new_v = v * _bcast(self.beta2, p) + g * g * _bcast(one_minus_b2, p)
            denom = new_v.sqrt() / _bcast(bc2_sqrt, p) + self.EPS
            new_p = new_p - _bcast(step_size, p) * (new_m / denom)
            p.copy_(torch.where(a, new_p, p))
            m.copy_(torch.where(a, new_m, m))
            v.copy_(torch.where(a, new_v, v))


def _clip_per_member(params: list[Tensor], clips: Tensor) -> Tensor:
    """clip_grad_norm_ for each member separately; returns the (M,) norms before clipping.

    A member without clipping (clip inf: `optim.grad_clip: null`) keeps its gradients as they
    are, as `workers.runners.unclipped_grad_norm` does alone: inf / (norm + 1e-6) would be
    inf / inf = nan once its float32 norm overflows, and turn finite gradients into nan."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch.stack([g.reshape(g.shape[0], -1).norm(dim=1) for g in grads])  # (P, M)
    total: Tensor = norms.norm(dim=0)  # (M,)
    coef = torch.clamp(clips / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isinf(clips), torch.ones_like(coef), coef)
    for g in grads:
        g.mul_(_bcast(coef, g))
    return total


def _builtin(model: QKModel) -> GPT:
    """The member's model as the built-in GPT (`check_fusable` refuses every other kind)."""
    if not isinstance(model, GPT):
        raise FusionError(f"only the built-in model fuses, not {type(model).__name__}")
    return model


def _sync_optimizer(mem: Member, m: int, opt: _BatchedOptimizer) -> None:
    """Member m's AdamW moments and step count into its torch optimizer's state (the format
    torch's own AdamW keeps, so the checkpoint resumes alone as well as fused)."""
    if opt.name != "adamw":
        return
    for i, p in enumerate(mem.model.parameters()):
        if not opt.touched[i]:
            continue  # torch keeps no state for a parameter never updated
        mem.optimizer.state[p] = {
            "step": opt.step_count[m].detach().cpu().clone(),
            "exp_avg": opt.exp_avg[i][m].detach().clone(),
            "exp_avg_sq": opt.exp_avg_sq[i][m].detach().clone(),
        }


def _restore_optimizer(mem: Member, m: int, opt: _BatchedOptimizer) -> None:
    """Member m's AdamW moments and step count from its torch optimizer's state."""
    if opt.name != "adamw":
        return
    with torch.no_grad():
        for i, p in enumerate(mem.model.parameters()):
            st = mem.optimizer.state.get(p)
            if not st:
                continue
            opt.touched[i] = True
            opt.exp_avg[i][m].copy_(st["exp_avg"])
            opt.exp_avg_sq[i][m].copy_(st["exp_avg_sq"])
            opt.step_count[m] = float(st["step"])


# --------------------------------------------------------------------------------------------
# The model runner
# --------------------------------------------------------------------------------------------


class FusedRunner:
    """Up to `capacity` members stacked as one FusedGPT with a batched optimizer."""

    def __init__(
        self, capacity: int, device: torch.device, ctx: AbstractContextManager[Any]
    ) -> None:
        self.capacity, self.device, self.ctx = capacity, device, ctx
        self.members: list[Member] = []
        self.fused: FusedGPT | None = None
        self.opt: _BatchedOptimizer | None = None

    def place(self, members: Sequence[Member]) -> None:
        if len(members) > self.capacity:
            raise ValueError(f"{len(members)} members for {self.capacity} slots")
        for slot, mem in enumerate(self.members):
            if mem in members:  # keep its state: out to its own model, back into the stack
                self.sync(slot, mem)
        self.members = list(members)
        if not members:
            self.fused = self.opt = None
            return
        for mem in members:
            check_fusable(mem.config)
        if len({fusion_key(m.config) for m in members}) > 1:
            raise FusionError("configs differ in fields that change the fused program")
        configs = [m.config for m in members]
        dev = self.device
        self.fused = FusedGPT.from_models([_builtin(m.model) for m in members], dev)
        self.opt = _BatchedOptimizer(configs, self.fused.parameters(), dev)
        for slot, mem in enumerate(members):
            _restore_optimizer(mem, slot, self.opt)
        self.clips = _per_member([c.optim.grad_clip or math.inf for c in configs], dev)
        self.use_penalty = [
            c.regularizer.kind != "none" and c.regularizer.lam != 0.0 for c in configs
        ]
        # members without a penalty get none computed (not 0 * penalty): kind "none" here
        self.kinds: list[RegularizerKind] = [
            c.regularizer.kind if use else "none"
            for c, use in zip(configs, self.use_penalty, strict=True)
        ]
        self.targets = [c.regularizer.target_mean for c in configs]
        self.lams = _hyper(
            [
                c.regularizer.lam if u else 0.0
                for c, u in zip(configs, self.use_penalty, strict=True)
            ],
            dev,
        )
        # z-loss only for the members that use it (no 0 * z term for the others)
        z_idx = [i for i, c in enumerate(configs) if c.z_loss_coef != 0.0]
        self.z_members = torch.tensor(z_idx, device=dev) if z_idx else None
        self.z_coefs = _hyper([configs[i].z_loss_coef for i in z_idx], dev)
        fwd = self.fused.losses
        self.forward: Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor | None]] = (
            torch.compile(fwd) if configs[0].compile else fwd  # type: ignore[assignment]
        )

    def train_step(self, batches: Sequence[tuple[Tensor, Tensor]], healthy: Tensor) -> StepOut:
        fused, opt = self.fused, self.opt
        assert fused is not None and opt is not None
        x = torch.stack([b[0] for b in batches])  # (M, B, T)
        y = torch.stack([b[1] for b in batches])
        factors = _hyper([m.lr_factor() for m in self.members], self.device)
        with self.ctx:
            loss, zsq = self.forward(x, y, self.z_members)  # (M,), (members with z-loss,)
        pen = fused.penalties(self.kinds, self.targets) if any(self.use_penalty) else None
        wide = torch.promote_types(loss.dtype, torch.float32)  # float64 members stay float64
        per_member = loss.to(wide)
        if zsq is not None and self.z_members is not None:  # z_coef rounded as torch does
            z_term = self.z_coefs.to(zsq.dtype) * zsq
            per_member = per_member.index_add(0, self.z_members, z_term.to(wide))
        if pen is not None:
            pen32 = pen.to(torch.promote_types(pen.dtype, wide))
            per_member = per_member + self.lams.to(pen32.dtype) * pen32  # lam rounded as torch does
        bad = ~(torch.isfinite(loss) & torch.isfinite(per_member))
        active = healthy & ~bad
        for p in fused.parameters():
            p.grad = None
        torch.where(active, per_member, torch.zeros_like(per_member)).sum().backward()  # type: ignore[no-untyped-call]
        grad_norm = _clip_per_member(fused.parameters(), self.clips)
        opt.step(factors, active)
        return StepOut(loss.detach(), None if pen is None else pen.detach(), grad_norm, bad)

    def sync(self, slot: int, member: Member) -> None:
        assert self.fused is not None and self.opt is not None
        self.fused.write_member(slot, _builtin(member.model))
        _sync_optimizer(member, slot, self.opt)


# --------------------------------------------------------------------------------------------
# A fixed group, trained to its end
# --------------------------------------------------------------------------------------------


def run_trial_group(
    configs: Sequence[TrialConfig],
    reporters: Sequence[Reporter | None] | None = None,
    stop_rules: Sequence[StopRule] = (),
) -> list[TrialSummary]:
    """Train the configs as one fused model; one summary per config, in order (with
    `stop_rules`: each member stops once it can no longer meet them).

    All configs must share a `fusion_key` and pass `check_fusable` (else FusionError).
    """
    if not configs:
        return []
    for cfg in configs:
        check_fusable(cfg)
    if len({fusion_key(c) for c in configs}) > 1:
        raise FusionError("configs differ in fields that change the fused program")
    reps = list(reporters) if reporters is not None else [None] * len(configs)
    if len(reps) != len(configs):
        raise ValueError(f"{len(configs)} configs but {len(reps)} reporters")
    device = resolve_device(configs[0])
    ctx = autocast_for(configs[0], device)
    engine = Engine(FusedRunner(len(configs), device, ctx), device, ctx)
    members = [
        new_member(c, r, device, stop_rules=stop_rules) for c, r in zip(configs, reps, strict=True)
    ]
    for mem in members:
        engine.admit(mem)
    engine.run()
    return [m.summary for m in members if m.summary is not None]
