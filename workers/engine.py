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
ordinary `GPT` with torch's optimizer (`run_trial`; workers/runners.py);
`workers.fused.FusedRunner` trains M members stacked on a member axis. Everything else
(evaluation, history, divergence, the stop record, the summary) is here, and a member's state
and checkpoint format in workers/member.py, once, for both.

Non-finite losses are caught on the device: each step folds them into a per-slot "first bad
step" without a host sync; the host reads it every `NAN_CHECK_EVERY` iterations, before every
evaluation and before the slots change, so the exact step of divergence is recorded (steps a
plain runner trained past it on NaN are discarded: nothing is evaluated, reported or
checkpointed after a bad step; a fused runner freezes the member at once).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from workers.checkpoints import claim_dir, read_stopped, write_stopped
from workers.config import MetricPoint, TrialStatus, TrialSummary
from workers.evaluation import init_points, intermediate_value, probe_metrics, summarize, val_loss
from workers.member import (
    Member,
    NullReporter,
    Reporter,
    autocast_for,
    build_model,
    load_checkpoint,
    lr_lambda,
    make_optimizer,
    new_member,
    resolve_device,
    save_checkpoint,
)
from workers.runners import ModelRunner, PlainRunner, StepOut

# Member, its setup and the runners live in workers/member.py and workers/runners.py; they
# are re-exported here, where they used to live.
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
    "new_member",
    "resolve_device",
]

NAN_CHECK_EVERY = 64
"""Iterations between host reads of the on-device divergence flags (also read at every
evaluation)."""


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
        load_checkpoint(mem, self.device, restore_rng=self.runner.capacity == 1)
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
        stop = mem.reporter.report(0, points, None)  # step 0: no objective value to prune on
        if not math.isfinite(points[0].value):
            mem.status, mem.diverged_at = TrialStatus.DIVERGED, 0
        elif (reason := self._stop_rule_reason(mem)) is not None:
            # the running maxima start here (METRICS.md 9): an untrained model whose logits
            # already break a bound can never meet it
            mem.status, mem.stop_reason = TrialStatus.PRUNED, reason
        elif mem.checkpoint_path is not None:  # a resume from here must not report it again
            save_checkpoint(mem)
        if mem.status == TrialStatus.COMPLETED and stop is not None:
            mem.status, mem.stop_reason = TrialStatus.PRUNED, stop
        if mem.status != TrialStatus.COMPLETED:
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
            if b and mem.status == TrialStatus.COMPLETED:
                mem.status, mem.diverged_at, mem.step = TrialStatus.DIVERGED, b, b - 1
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
        heard = self._heard_stops(evaluating)
        if not evaluating and not heard and self.iterations % NAN_CHECK_EVERY != 0:
            return
        stopped = self._check_divergence() + heard
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

    def _heard_stops(self, evaluating: list[Member]) -> list[Member]:
        """Members whose owner's pruner stopped them since their last evaluation (the verdict
        on its report arrived while they trained on): each stops as of that evaluation, the
        steps trained since are discarded, as a pruner in the same process would have stopped
        it there. Members evaluating now hear it in their report's answer instead."""
        heard = []
        for mem in self.running:
            if mem.poll is None or mem in evaluating or not mem.hist.steps:
                continue
            if mem.status == TrialStatus.COMPLETED and (reason := mem.poll()) is not None:
                mem.status, mem.stop_reason, mem.step = (
                    TrialStatus.PRUNED,
                    reason,
                    mem.hist.steps[-1],
                )
                heard.append(mem)
        return heard

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
                mem.status, mem.diverged_at = TrialStatus.DIVERGED, mem.step
                return True
            # judged before the checkpoint, which keeps the stopper's counts of this step
            reason = None
            if mem.stopper is not None and now is not None:
                reason = mem.stopper.check(mem.step, now)
            if reason is not None:
                mem.status, mem.stop_reason = TrialStatus.PRUNED, reason
                return True
            every = mem.config.checkpoint.every_evals
            if mem.checkpoint_path is not None and mem.n_evals % every == 0:
                save_checkpoint(mem)
        except OSError as e:
            if self.on_error is None:
                raise
            mem.error = e  # it leaves; the others go on
            return True
        if stop is not None:
            mem.status, mem.stop_reason = TrialStatus.PRUNED, stop
            return True
        return False

    def _stop_rule_reason(self, mem: Member) -> str | None:
        """Why the member's stop rules end it at its current evaluation, or None."""
        if mem.stopper is None:
            return None
        return mem.stopper.check(mem.step, self._summary_here(mem))

    def _summary_here(self, mem: Member) -> TrialSummary:
        """The summary the member would have if it stopped here: what its stop rules judge
        and its objective's intermediate value is read from."""
        return summarize(
            mem.config,
            mem.task,
            mem.hist,
            TrialStatus.COMPLETED,
            mem.step - mem.start,
            None,
            0.0,
            self.device,
        )

    def run(self) -> None:
        """Train until every admitted member has finished."""
        while self.running:
            self.iterate()
