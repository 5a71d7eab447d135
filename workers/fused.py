"""Fused trials: several trials of one architecture trained together as one `FusedGPT`.

`run_trial_group(configs, reporters)` is `workers.trial.run_trial` for M trials at once.
Each member keeps everything that makes it its own trial: hyperparameters (learning rate,
weight decay, betas, gradient clip, regularizer kind/lambda/target mean, QK init scale,
attention temperature), seed (and so its init, its data order and, for synthetic tasks, its
validation set), loss, probes, metrics, reports, checkpoint and `TrialSummary`.

The contract is equality: on CPU in float32, a member's evaluation losses match the same
config run alone by `run_trial` (within 1e-4 relative at quickstart sizes; float rounding of
batched vs single matmuls is the only difference, and every per-member scalar is computed in
float64 as torch computes its Python floats, so in float64 a member matches alone to 1e-8 or
better). Large `qk_init_std` (>= ~0.2) makes a trial chaotic: it amplifies float32 rounding
to ~1e-2 by a few hundred steps, so there fused and alone part by as much as the same trial
with 1e-7 noise on its initial weights (bench/README.md, "fused: equality").

Checkpoints are written in `run_trial`'s format to the member's own `checkpoint.dir`, so a
member can resume alone and a single trial can resume as a member.

Stopping is by **masking**, not regrouping: a member that diverges, is pruned or has not
reached its resume step yet keeps its slot, and its weights and optimizer state are frozen by
`torch.where` (members never mix, so its NaNs cannot reach the others). Its compute is wasted
until the group ends; regrouping would save it at the cost of re-stacking state mid-run.

Non-finite losses are detected on the device: each step folds them into a per-member "first
bad step" without a host sync, and the host reads it every `NAN_CHECK_EVERY` steps and before
every evaluation, so the exact step of divergence is still recorded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from workers.config import TrialConfig, TrialStatus, TrialSummary
from workers.fused_model import FusedGPT
from workers.fusion_plan import (
    FusionError,
    check_fusable,
    fusion_key,
    group_by_key,
)
from workers.model import GPT
from workers.tasks import Task, build_task
from workers.trial import (
    NAN_CHECK_EVERY,
    MetricPoint,
    NullReporter,
    Reporter,
    _autocast,
    _checkpoint_path,
    _History,
    _init_points,
    _lr_lambda,
    _optimizer,
    _save_checkpoint,
    _summarize,
    _val_loss,
    build_model,
    probe_metrics,
    resolve_device,
)

__all__ = ["FusionError", "check_fusable", "fusion_key", "group_by_key", "run_trial_group"]


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
        self.wd = _hyper([c.optim.weight_decay for c in configs], dev)
        self.beta1 = _hyper([c.optim.beta1 for c in configs], dev)
        self.beta2 = _hyper([c.optim.beta2 for c in configs], dev)
        self.step_count = torch.zeros(len(configs), dtype=torch.float32, device=dev)
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, factor: float, active: Tensor) -> None:
        lr = self.lr * factor
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
        for p, m, v in zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True):
            if p.grad is None:  # unused by this architecture: skipped, as torch does
                continue
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
    """clip_grad_norm_ for each member separately; returns the (M,) norms before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads])  # (P, M)
    total: Tensor = norms.norm(dim=0)  # (M,)
    coef = torch.clamp(clips / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(_bcast(coef, g))
    return total


# --------------------------------------------------------------------------------------------
# One member: its task, template model (probes, checkpoints) and bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass
class _Member:
    config: TrialConfig
    reporter: Reporter
    task: Task
    model: GPT  # a plain GPT: weights copied in for probes, val loss and checkpoints
    optimizer: torch.optim.Optimizer  # template for checkpoints in run_trial's format
    scheduler: torch.optim.lr_scheduler.LambdaLR
    data_gen: torch.Generator
    probe_x: Tensor
    val_batches: list[tuple[Tensor, Tensor]]
    hist: _History = field(default_factory=_History.empty)
    start: int = 0  # step resumed from
    step: int = 0  # updates done
    n_evals: int = 0
    status: TrialStatus = "completed"
    diverged_at: int | None = None
    running: bool = True


def _member(config: TrialConfig, reporter: Reporter, device: torch.device) -> _Member:
    task = build_task(config.task, config.seed)
    model = build_model(config, task).to(device)
    optimizer = _optimizer(config, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(config))
    probe_x, _ = task.train_batch(
        config.probe_batch_size, torch.Generator().manual_seed(config.seed + 7919)
    )
    return _Member(
        config=config,
        reporter=reporter,
        task=task,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data_gen=torch.Generator().manual_seed(config.seed),
        probe_x=probe_x.to(device),
        val_batches=task.valid_batches(config.batch_size)[: config.eval_batches],
    )


def _load(mem: _Member, device: torch.device) -> dict[str, Any] | None:
    ckpt = _checkpoint_path(mem.config)
    if ckpt is None or not ckpt.exists():
        return None
    state: dict[str, Any] = torch.load(ckpt, map_location=device, weights_only=False)
    mem.model.load_state_dict(state["model"])
    mem.optimizer.load_state_dict(state["optimizer"])
    mem.scheduler.load_state_dict(state["scheduler"])
    mem.data_gen.set_state(state["data_gen"])
    mem.hist, mem.start, mem.n_evals = state["history"], state["step"], state["n_evals"]
    mem.step = mem.start
    return state


def _save(mem: _Member, m: int, fused: FusedGPT, opt: _BatchedOptimizer) -> None:
    """Member m's checkpoint, in exactly the format `run_trial` writes and reads."""
    ckpt = _checkpoint_path(mem.config)
    assert ckpt is not None
    fused.write_member(m, mem.model)
    if opt.name == "adamw":
        for i, p in enumerate(mem.model.parameters()):
            if opt.params[i].grad is None:  # torch keeps no state for a param never updated
                continue
            mem.optimizer.state[p] = {
                "step": opt.step_count[m].detach().cpu().clone(),
                "exp_avg": opt.exp_avg[i][m].detach().clone(),
                "exp_avg_sq": opt.exp_avg_sq[i][m].detach().clone(),
            }
    sched = mem.scheduler
    sched.last_epoch = mem.step
    lrs = [base * _lr_lambda(mem.config)(mem.step) for base in sched.base_lrs]
    for group, lr in zip(mem.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    sched._last_lr = lrs  # type: ignore[attr-defined]
    _save_checkpoint(
        ckpt,
        {
            "model": mem.model.state_dict(),
            "optimizer": mem.optimizer.state_dict(),
            "scheduler": sched.state_dict(),
            "data_gen": mem.data_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "history": mem.hist,
            "step": mem.step,
            "n_evals": mem.n_evals,
        },
    )


def _restore_optimizer(mem: _Member, m: int, opt: _BatchedOptimizer) -> None:
    """Member m's AdamW moments and step count from its (loaded) template optimizer."""
    if opt.name != "adamw":
        return
    with torch.no_grad():
        for i, p in enumerate(mem.model.parameters()):
            st = mem.optimizer.state.get(p)
            if not st:
                continue
            opt.exp_avg[i][m].copy_(st["exp_avg"])
            opt.exp_avg_sq[i][m].copy_(st["exp_avg_sq"])
            opt.step_count[m] = float(st["step"])


# --------------------------------------------------------------------------------------------
# The group loop
# --------------------------------------------------------------------------------------------


def _evaluate(
    mem: _Member,
    m: int,
    fused: FusedGPT,
    ctx: Any,
    device: torch.device,
    train_loss: float,
    grad_norm: float,
    penalty: float | None,
) -> tuple[list[MetricPoint], float]:
    """The evaluation `run_trial` makes at this step, on member m's weights."""
    fused.write_member(m, mem.model)
    val = _val_loss(mem.model, mem.val_batches, ctx, device)
    points = [
        MetricPoint("train_loss", train_loss),
        MetricPoint("val_loss", val),
        MetricPoint("grad_norm", grad_norm),
        MetricPoint("lr", mem.config.optim.lr * _lr_lambda(mem.config)(mem.step)),
    ]
    if penalty is not None:
        points.append(MetricPoint("reg_penalty", penalty))
    points += probe_metrics(mem.model, mem.probe_x)
    return points, val


def run_trial_group(
    configs: Sequence[TrialConfig],
    reporters: Sequence[Reporter | None] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> list[TrialSummary]:
    """Train the configs as one fused model; one summary per config, in order.

    All configs must share a `fusion_key` and pass `check_fusable` (else FusionError).
    """
    if not configs:
        return []
    for cfg in configs:
        check_fusable(cfg)
    keys = {fusion_key(c) for c in configs}
    if len(keys) > 1:
        raise FusionError("configs differ in fields that change the fused program")
    reps: list[Reporter] = [r or NullReporter() for r in (reporters or [None] * len(configs))]
    if len(reps) != len(configs):
        raise ValueError(f"{len(configs)} configs but {len(reps)} reporters")
    base = configs[0]
    device = resolve_device(base)
    ctx = _autocast(base, device)
    members = [_member(c, r, device) for c, r in zip(configs, reps, strict=True)]
    states = [_load(mem, device) for mem in members]
    fused = FusedGPT.from_models([mem.model for mem in members], device)
    opt = _BatchedOptimizer(configs, fused.parameters(), device)
    for m, (mem, st) in enumerate(zip(members, states, strict=True)):
        if st is not None:
            _restore_optimizer(mem, m, opt)
    n = len(members)
    clips = _per_member([c.optim.grad_clip or math.inf for c in configs], device)
    lams = _hyper(
        [c.regularizer.lam if c.regularizer.kind != "none" else 0.0 for c in configs], device
    )
    kinds = [c.regularizer.kind for c in configs]
    targets = [c.regularizer.target_mean for c in configs]
    use_penalty = [
        k != "none" and c.regularizer.lam != 0.0 for k, c in zip(kinds, configs, strict=True)
    ]
    factor = _lr_lambda(base)
    forward: Callable[[Tensor, Tensor], Tensor] = (
        torch.compile(fused.forward) if base.compile else fused.forward  # type: ignore[assignment]
    )
    t0 = time.perf_counter()

    # eval_at_init, per member, exactly as run_trial does it
    for mem in members:
        if base.eval_at_init and mem.start == 0 and mem.hist.init_points is None:
            reg = mem.config.regularizer
            points = _init_points(mem.model, mem.val_batches, ctx, device, reg, mem.probe_x)
            points.insert(1, MetricPoint("lr", mem.config.optim.lr * factor(0)))
            mem.hist.init_points = points
            stop = mem.reporter.report(0, points)
            if not math.isfinite(points[0].value):
                mem.status, mem.diverged_at, mem.running = "diverged", 0, False
            else:
                if _checkpoint_path(mem.config) is not None:
                    _save(mem, members.index(mem), fused, opt)
                if stop:
                    mem.status, mem.running = "pruned", False
    for mem in members:
        if mem.step >= base.steps:
            mem.running = False

    masks: dict[tuple[bool, ...], Tensor] = {}

    def mask(flags: tuple[bool, ...]) -> Tensor:
        """A device bool mask, made once per distinct pattern (no H2D copy per step)."""
        if flags not in masks:
            masks[flags] = torch.tensor(flags, device=device)
        return masks[flags]

    running = mask(tuple(mem.running for mem in members))
    first_bad = torch.zeros(n, dtype=torch.int64, device=device)
    pin = device.type == "cuda"
    step = min((mem.step for mem in members if mem.running), default=base.steps)
    shape = (base.batch_size, members[0].task.seq_len)
    last_x = [torch.zeros(shape, dtype=torch.int64) for _ in members]
    last_y = [torch.full(shape, -100, dtype=torch.int64) for _ in members]
    loss = pen = grad_norm = torch.zeros(n, device=device)
    while any(mem.running for mem in members) and step < base.steps:
        stepping = tuple(mem.running and mem.step == step for mem in members)  # not waiting
        active = running & mask(stepping)
        for i, mem in enumerate(members):
            if stepping[i]:
                last_x[i], last_y[i] = mem.task.train_batch(base.batch_size, mem.data_gen)
        x, y = torch.stack(last_x), torch.stack(last_y)  # (M, B, T)
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with ctx:
            loss = forward(x, y)
            pen = fused.penalties(kinds, targets) if any(use_penalty) else torch.zeros_like(loss)
        pen32 = pen.float()
        per_member = loss.float() + lams.to(pen32.dtype) * pen32  # lam rounded as torch rounds it
        bad = active & ~(torch.isfinite(loss) & torch.isfinite(per_member))
        first_bad = torch.where(bad & (first_bad == 0), step + 1, first_bad)
        active = active & ~bad
        running = running & ~bad
        for p in fused.parameters():
            p.grad = None
        torch.where(active, per_member, torch.zeros_like(per_member)).sum().backward()  # type: ignore[no-untyped-call]
        grad_norm = _clip_per_member(fused.parameters(), clips)
        opt.step(factor(step), active)
        step += 1
        for i, mem in enumerate(members):
            if stepping[i]:
                mem.step = step
        if progress is not None:
            progress(step)
        at_eval = step % base.eval_every == 0 or step == base.steps
        if not at_eval and step % NAN_CHECK_EVERY != 0:
            continue
        # host decisions: divergence first (exact step), then evaluations
        bad_at = first_bad.tolist()
        for mem, b in zip(members, bad_at, strict=True):
            if mem.running and b:
                mem.status, mem.diverged_at, mem.running = "diverged", b, False
                mem.step = b - 1
        if not at_eval:
            continue
        losses, norms, pens = loss.tolist(), grad_norm.tolist(), pen.tolist()
        for m, mem in enumerate(members):
            if not (stepping[m] and mem.running):
                continue
            points, val = _evaluate(
                mem,
                m,
                fused,
                ctx,
                device,
                losses[m],
                norms[m],
                pens[m] if use_penalty[m] else None,
            )
            mem.hist.steps.append(step)
            mem.hist.val_losses.append(val)
            mem.hist.train_losses.append(losses[m])
            mem.hist.min_norm_entropies.append(
                min((p.value for p in points if p.name == "attn_entropy_norm"), default=math.nan)
            )
            mem.hist.last_points = points
            mem.n_evals += 1
            stop = mem.reporter.report(step, points)
            if not math.isfinite(val):
                mem.status, mem.diverged_at, mem.running = "diverged", step, False
                continue
            if (
                _checkpoint_path(mem.config) is not None
                and mem.n_evals % mem.config.checkpoint.every_evals == 0
            ):
                _save(mem, m, fused, opt)
            if stop:
                mem.status, mem.running = "pruned", False
        for mem in members:
            if mem.step >= base.steps:
                mem.running = False
        running = mask(tuple(mem.running for mem in members)) & ~(first_bad > 0)

    elapsed = time.perf_counter() - t0
    return [
        _summarize(
            mem.config,
            mem.task,
            mem.hist,
            mem.status,
            mem.step - mem.start,
            mem.diverged_at,
            elapsed,
            device,
        ).model_copy(update={"steps_done": mem.step})
        for mem in members
    ]
