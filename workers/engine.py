"""The trial engine: one training loop for 1..M trials ("members") that share a model runner.

Its shape is a continuous-batching engine's: `Engine` owns the running members and a budget
of slots (`ModelRunner.capacity`); `admit` puts a member in a free slot (resuming it from its
checkpoint), and each `iterate` is schedule -> one batched training step -> post-process:
divergence, evaluations, reports, checkpoints, stops. A member that stops (completed,
pruned, diverged) is finished at once: its stop is recorded durably beside its checkpoint
(workers/checkpoints.py: no retry or restart ever trains it again), its summary goes to
`on_finish`, and its slot is free for the next member while the others keep training, each at
its own step of its own schedule.

The model runner knows tensors and nothing about members' lives: `PlainRunner` trains one
ordinary `GPT` with torch's optimizer (`run_trial`); `workers.fused.FusedRunner` trains M
members stacked on a member axis. Everything else (evaluation, history, checkpoint format,
divergence, the stop record, the summary) is here, once, for both.

Non-finite losses are caught on the device: each step folds them into a per-slot "first bad
step" without a host sync; the host reads it every `NAN_CHECK_EVERY` iterations, before every
evaluation and before the slots change, so the exact step of divergence is recorded (steps a
plain runner trained past it on NaN are discarded: nothing is evaluated, reported or
checkpointed after a bad step; a fused runner freezes the member at once).
"""

from __future__ import annotations

import errno
import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from workers.checkpoints import claim_dir, read_stopped, write_stopped
from workers.config import MetricPoint, TrialConfig, TrialStatus, TrialSummary
from workers.evaluation import (
    History,
    init_points,
    intermediate_value,
    penalty,
    probe_metrics,
    summarize,
    val_loss,
)
from workers.model import GPT
from workers.regularizers import z_loss
from workers.stopping import Stopper, StopRule
from workers.tasks import Task, build_task

__all__ = [
    "NAN_CHECK_EVERY",
    "Engine",
    "Member",
    "ModelRunner",
    "NullReporter",
    "PlainRunner",
    "Reporter",
    "StepOut",
    "autocast_for",
    "build_model",
    "lr_lambda",
    "make_optimizer",
    "resolve_device",
]

NAN_CHECK_EVERY = 64
"""Iterations between host reads of the on-device divergence flags (also read at every
evaluation)."""


class Reporter(Protocol):
    """Receives each evaluation and, with an objective, its intermediate value (None
    without one); returns why the trial should stop (its owner's pruner said so), or None
    to go on."""

    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None: ...


class NullReporter:
    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None:
        return None


# ---- training setup, per trial ----------------------------------------------------------------


def resolve_device(config: TrialConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but CUDA is not available on this node")
    return torch.device(config.device)


def autocast_for(config: TrialConfig, device: torch.device) -> AbstractContextManager[Any]:
    use_bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def lr_lambda(config: TrialConfig) -> Callable[[int], float]:
    """The learning-rate factor of step `step` (warmup, then constant or cosine to 0.1)."""
    warmup, total, schedule = config.optim.warmup_steps, config.steps, config.optim.schedule

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def make_optimizer(config: TrialConfig, model: GPT) -> torch.optim.Optimizer:
    """AdamW (fused kernel on CUDA, foreach on CPU) or SGD, from the trial's settings."""
    o = config.optim
    cuda = next(model.parameters()).device.type == "cuda"
    if o.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=o.lr, weight_decay=o.weight_decay, foreach=not cuda or None
        )
    return torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        weight_decay=o.torch_weight_decay,  # independent decay: wd / lr (config.py)
        betas=(o.beta1, o.beta2),
        fused=True if cuda else None,
        foreach=None if cuda else True,
    )


def build_model(config: TrialConfig, task: Task) -> GPT:
    """The trial's model, initialised from the trial seed (in float64 for `dtype: float64`:
    drawn in float32 as always, then widened, so float32 and float64 trials of one seed
    start from the same weights)."""
    torch.manual_seed(config.seed)
    model = GPT(config.model, vocab_size=task.vocab_size, seq_len=task.seq_len)
    return model.to(torch.float64) if config.dtype == "float64" else model


# ---- a member: one trial's state, whatever runner trains it -----------------------------------


@dataclass
class Member:
    """One trial in the engine. `model` and `optimizer` are its own GPT and torch optimizer:
    a plain runner trains them directly; a fused runner copies its slot into them before an
    evaluation or a checkpoint, so both read and write one checkpoint format."""

    config: TrialConfig
    reporter: Reporter
    task: Task
    model: GPT
    optimizer: torch.optim.Optimizer
    data_gen: torch.Generator
    probe_x: Tensor
    val_batches: list[tuple[Tensor, Tensor]]
    probe_targets: Tensor | None = None  # the answer's key position per probe query
    hist: History = field(default_factory=History.empty)
    start: int = 0  # the step this execution resumed from
    step: int = 0  # updates done
    n_evals: int = 0
    status: TrialStatus = "completed"
    diverged_at: int | None = None
    admitted: float = 0.0  # perf_counter at admission: the member's own wall time
    summary: TrialSummary | None = None  # set when it has finished
    tag: Any = None  # the caller's handle (e.g. the trial number)
    stopper: Stopper | None = None  # the study's constraints, checked at every evaluation
    objective: str | None = None  # the summary whose intermediate value each report carries
    stop_reason: str | None = None
    error: OSError | None = None  # its own storage failed: it leaves without a result

    @property
    def checkpoint_path(self) -> Path | None:
        d = self.config.checkpoint.dir
        return Path(d) / "checkpoint.pt" if d else None

    def lr_factor(self) -> float:
        return lr_lambda(self.config)(self.step)

    def at_eval(self) -> bool:
        return self.step % self.config.eval_every == 0 or self.step == self.config.steps


def new_member(
    config: TrialConfig,
    reporter: Reporter | None,
    device: torch.device,
    tag: Any = None,
    stop_rules: Sequence[StopRule] = (),
    objective: str | None = None,
) -> Member:
    """A member at step 0, from its seed (its data, init, probe batch and data order); with
    `stop_rules`, stopped (pruned) at the first evaluation after which it can no longer meet
    them (workers/stopping.py); with `objective` (a summary metric with an intermediate
    value), each report carries that summary had the trial stopped there."""
    if objective is not None:
        from workers.metric_names import SUMMARY_BY_NAME

        entry = SUMMARY_BY_NAME.get(objective)
        if entry is None or not entry.intermediate:
            raise ValueError(f"{objective!r} has no intermediate value to report")
    task = build_task(config.task, config.seed)
    model = build_model(config, task).to(device)
    probe_x, _ = task.train_batch(
        config.probe_batch_size, torch.Generator().manual_seed(config.seed + 7919)
    )
    targets = task.attention_targets(probe_x)
    return Member(
        config=config,
        reporter=reporter or NullReporter(),
        task=task,
        model=model,
        optimizer=make_optimizer(config, model),
        data_gen=torch.Generator().manual_seed(config.seed),
        probe_x=probe_x.to(device),
        val_batches=task.valid_batches(config.batch_size)[: config.eval_batches],
        probe_targets=None if targets is None else targets.to(device),
        tag=tag,
        stopper=Stopper(list(stop_rules)) if stop_rules else None,
        objective=objective,
    )


def _load_checkpoint(mem: Member, device: torch.device, restore_rng: bool) -> None:
    path = mem.checkpoint_path
    if path is None or not path.exists():
        return
    state = torch.load(path, map_location=device, weights_only=False)
    mem.model.load_state_dict(state["model"])
    mem.optimizer.load_state_dict(state["optimizer"])
    mem.data_gen.set_state(state["data_gen"])
    if restore_rng:  # dropout draws from the global generator (plain runner only)
        torch.set_rng_state(state["torch_rng"])
    mem.hist, mem.start, mem.n_evals = state["history"], state["step"], state["n_evals"]
    mem.step = mem.start
    if mem.stopper is not None:  # violations in a row go on counting from the checkpoint
        mem.stopper.restore(state.get("stopper"))


def _save_checkpoint(mem: Member) -> None:
    """Atomic and durable: written to `checkpoint.tmp`, fsynced, renamed over
    `checkpoint.pt`, then the directory fsynced, so a crash or a power loss leaves the
    previous checkpoint or the new one, whole (without the fsyncs the rename can reach the
    disk before the data: an empty or partial checkpoint after a power loss). A failed write
    (a full disk) removes its `checkpoint.tmp` and raises; one left by a kill mid-write is
    removed when the directory is next claimed (workers/checkpoints.py)."""
    from workers.checkpoints import fsync_dir

    path = mem.checkpoint_path
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": mem.model.state_dict(),
        "optimizer": mem.optimizer.state_dict(),
        "data_gen": mem.data_gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "history": mem.hist,
        "step": mem.step,
        "n_evals": mem.n_evals,
        "stopper": None if mem.stopper is None else mem.stopper.state(),
    }
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(state, f)
            except RuntimeError as e:
                # torch's zip writer reports a short write (a full disk, a file-size limit)
                # as RuntimeError("... unexpected pos ..."): a storage failure like any other
                if "unexpected pos" not in str(e):
                    raise
                raise OSError(errno.ENOSPC, f"checkpoint write to {tmp} failed: {e}") from e
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


# ---- model runners ---------------------------------------------------------------------------


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
        grad_norm = torch.nn.utils.clip_grad_norm_(
            mem.model.parameters(), clip if clip is not None else math.inf
        )
        opt.step()
        return StepOut(
            loss.detach().view(1),
            None if pen is None else pen.detach().view(1),
            grad_norm.view(1),
            bad.view(1),
        )

    def sync(self, slot: int, member: Member) -> None:
        """Nothing to copy: the member's own model and optimizer are what trains."""


# ---- the engine -------------------------------------------------------------------------------


class Engine:
    """Admits members into the runner's slots, steps them together, finishes each alone."""

    def __init__(
        self,
        runner: ModelRunner,
        device: torch.device,
        ctx: AbstractContextManager[Any],
        on_finish: Callable[[Member], None] | None = None,
        progress: Callable[[int], None] | None = None,
        on_error: Callable[[Member, OSError], None] | None = None,
    ) -> None:
        self.runner, self.device, self.ctx = runner, device, ctx
        self.on_finish = on_finish or (lambda mem: None)
        # A member's own storage failing (its checkpoint, journal or stop record: a full
        # disk, a lost mount): with `on_error` the member leaves alone and the others train
        # on; without, the error propagates (run_trial).
        self.on_error = on_error
        self.progress = progress  # called after each iteration with the engine's iteration
        self.running: list[Member] = []
        self.iterations = 0
        self.steps_run = 0  # member-steps trained (a benchmark's measure of compute spent)
        self._first_bad = torch.zeros(0, dtype=torch.int64, device=device)
        self._steps = torch.zeros(0, dtype=torch.int64, device=device)

    @property
    def free_slots(self) -> int:
        return self.runner.capacity - len(self.running)

    # ---- admission and finishing ------------------------------------------------------------

    def admit(self, mem: Member) -> None:
        """Resume `mem` from its checkpoint and give it a slot; a member that already stopped
        (or stops at its step-0 evaluation) is finished without training."""
        if self.free_slots <= 0:
            raise RuntimeError("no free slot")
        cfg = mem.config
        claim_dir(cfg.checkpoint.dir, cfg.checkpoint.owner)
        mem.admitted = time.perf_counter()
        stopped = read_stopped(cfg.checkpoint.dir)
        if stopped is not None:  # it stopped in an earlier execution: never train it again
            mem.summary = TrialSummary.model_validate(stopped["summary"])
            mem.status, mem.step = mem.summary.status, mem.summary.steps_done
            self.on_finish(mem)
            return
        _load_checkpoint(mem, self.device, restore_rng=self.runner.capacity == 1)
        fresh = cfg.eval_at_init and mem.start == 0 and mem.hist.init_points is None
        if fresh and self._evaluate_init(mem):
            return
        if mem.step >= cfg.steps:
            self._finish(mem)
            return
        bad = self._check_divergence()  # read the flags before the slots change
        for m in bad:
            self.running.remove(m)
        self.running.append(mem)
        self._replace()
        for m in bad:
            self._finish(m)

    def _evaluate_init(self, mem: Member) -> bool:
        """The untrained model, reported as step 0 (evaluation draws no randomness, so the
        training that follows is unchanged); True when the member stopped there."""
        points = init_points(
            mem.model,
            mem.val_batches,
            self.ctx,
            self.device,
            mem.config.regularizer,
            mem.probe_x,
            mem.probe_targets,
        )
        points.insert(1, MetricPoint("lr", mem.config.optim.lr * mem.lr_factor()))
        mem.hist.init_points = points
        stop = mem.reporter.report(0, points, None)  # step 0: nothing trained to judge yet
        if not math.isfinite(points[0].value):
            mem.status, mem.diverged_at = "diverged", 0
        elif mem.checkpoint_path is not None:  # a resume from here must not report it again
            _save_checkpoint(mem)
        if mem.status == "completed" and stop is not None:
            mem.status, mem.stop_reason = "pruned", stop
        if mem.status != "completed":
            self._finish(mem)
            return True
        return False

    def _replace(self) -> None:
        """Hand the runner the members now running; restart the on-device flags."""
        self.runner.place(self.running)
        n = len(self.running)
        self._first_bad = torch.zeros(n, dtype=torch.int64, device=self.device)
        self._steps = torch.tensor([m.step for m in self.running], device=self.device)

    def _finish(self, mem: Member) -> None:
        """Summarise, record the stop durably, then tell the owner (the slot is free now)."""
        if mem.error is not None:
            assert self.on_error is not None
            self.on_error(mem, mem.error)
            return
        elapsed = time.perf_counter() - mem.admitted
        mem.summary = summarize(
            mem.config,
            mem.task,
            mem.hist,
            mem.status,
            mem.step - mem.start,
            mem.diverged_at,
            elapsed,
            self.device,
        ).model_copy(update={"steps_done": mem.step, "stop_reason": mem.stop_reason})
        record = {
            "status": mem.status,
            "step": mem.step,
            "summary": mem.summary.model_dump(mode="json"),
        }
        try:
            write_stopped(mem.config.checkpoint.dir, record)
        except OSError as e:
            if self.on_error is None:
                raise
            self.on_error(mem, e)
            return
        self.on_finish(mem)

    def _stop(self, stopped: list[Member]) -> None:
        for mem in stopped:
            self.running.remove(mem)
        if stopped:
            self._replace()
        for mem in stopped:
            self._finish(mem)

    # ---- one iteration --------------------------------------------------------------------

    def _batches(self) -> list[tuple[Tensor, Tensor]]:
        pin = self.device.type == "cuda"
        out = []
        for mem in self.running:
            x, y = mem.task.train_batch(mem.config.batch_size, mem.data_gen)
            if pin:  # pinned + async copy: the next batch is drawn while the device computes
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return out

    def _check_divergence(self) -> list[Member]:
        """Members whose loss went non-finite since the last check, set diverged at that step."""
        if not self.running:
            return []
        bad = []
        for mem, b in zip(self.running, self._first_bad.tolist(), strict=True):
            if b and mem.status == "completed":
                mem.status, mem.diverged_at, mem.step = "diverged", b, b - 1
                bad.append(mem)
        return bad

    def iterate(self) -> None:
        """One batched step of every running member, then its evaluations and stops."""
        if not self.running:
            return
        healthy = self._first_bad == 0
        out = self.runner.train_step(self._batches(), healthy)
        self._first_bad = torch.where(
            out.bad & healthy, self._steps + 1, self._first_bad
        )  # the first bad step of each slot, 0 = none
        self._steps += 1
        self.iterations += 1
        self.steps_run += len(self.running)
        for mem in self.running:
            mem.step += 1
        if self.progress is not None:
            self.progress(self.running[0].step if len(self.running) == 1 else self.iterations)
        evaluating = [m for m in self.running if m.at_eval()]
        if not evaluating and self.iterations % NAN_CHECK_EVERY != 0:
            return
        stopped = self._check_divergence()
        losses = out.loss.tolist() if evaluating else []
        norms = out.grad_norm.tolist() if evaluating else []
        pens = out.penalty.tolist() if evaluating and out.penalty is not None else []
        for slot, mem in enumerate(self.running):
            if mem in stopped or mem not in evaluating:
                continue
            reg = mem.config.regularizer
            pen = pens[slot] if pens and reg.kind != "none" and reg.lam != 0.0 else None
            stops = self._evaluate(slot, mem, losses[slot], norms[slot], pen)
            if stops or mem.step >= mem.config.steps:
                stopped.append(mem)
        self._stop(stopped)

    def _evaluate(
        self, slot: int, mem: Member, train_loss: float, grad_norm: float, pen: float | None
    ) -> bool:
        """Measure, report and checkpoint the member at its step; True when it stops here."""
        self.runner.sync(slot, mem)
        val = val_loss(mem.model, mem.val_batches, self.ctx, self.device)
        points = [
            MetricPoint("train_loss", train_loss),
            MetricPoint("val_loss", val),
            MetricPoint("grad_norm", grad_norm),
            MetricPoint("lr", mem.config.optim.lr * mem.lr_factor()),
        ]
        if pen is not None:
            points.append(MetricPoint("reg_penalty", pen))
        points += probe_metrics(mem.model, mem.probe_x, mem.probe_targets)
        mem.hist.steps.append(mem.step)
        mem.hist.val_losses.append(val)
        mem.hist.train_losses.append(train_loss)
        mem.hist.min_norm_entropies.append(
            min((p.value for p in points if p.name == "attn_entropy_norm"), default=math.nan)
        )
        mem.hist.last_points = points
        mem.hist.record_signals(points)
        mem.n_evals += 1
        now = self._summary_here(mem) if mem.stopper or mem.objective else None
        value = None
        if now is not None and mem.objective is not None:
            value = intermediate_value(now, mem.objective)
        try:
            stop = mem.reporter.report(mem.step, points, value)  # journaled beside the checkpoint
            if not math.isfinite(val):
                mem.status, mem.diverged_at = "diverged", mem.step
                return True
            # judged before the checkpoint, which keeps the stopper's counts of this step
            reason = None
            if mem.stopper is not None and now is not None:
                reason = mem.stopper.check(mem.step, now)
            if reason is not None:
                mem.status, mem.stop_reason = "pruned", reason
                return True
            every = mem.config.checkpoint.every_evals
            if mem.checkpoint_path is not None and mem.n_evals % every == 0:
                _save_checkpoint(mem)
        except OSError as e:
            if self.on_error is None:
                raise
            mem.error = e  # it leaves; the others go on
            return True
        if stop is not None:
            mem.status, mem.stop_reason = "pruned", stop
            return True
        return False

    def _summary_here(self, mem: Member) -> TrialSummary:
        """The summary the member would have if it stopped here: what its stop rules judge
        and its objective's intermediate value is read from."""
        return summarize(
            mem.config,
            mem.task,
            mem.hist,
            "completed",
            mem.step - mem.start,
            None,
            0.0,
            self.device,
        )

    def run(self) -> None:
        """Train until every admitted member has finished."""
        while self.running:
            self.iterate()
