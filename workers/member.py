"""One trial in the trial engine (workers/engine.py): its training setup, its state
(`Member`), how it is made from its config (`new_member`) and its checkpoint.

A member's `model` and `optimizer` are its own GPT and torch optimizer, whatever runner trains
it (workers/runners.py, workers/fused.py), so both runners read and write one checkpoint
format: `checkpoint.pt` in the trial's checkpoint directory, written atomically and durably
(workers/checkpoints.py, `durable_write`).
"""

from __future__ import annotations

import errno
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from workers.checkpoints import durable_write
from workers.config import MetricPoint, TrialConfig, TrialStatus, TrialSummary
from workers.evaluation import History
from workers.models import QKModel, build
from workers.stopping import Stopper, StopRule
from workers.tasks import Task, build_task

__all__ = [
    "Member",
    "NullReporter",
    "Reporter",
    "autocast_for",
    "build_model",
    "load_checkpoint",
    "lr_lambda",
    "make_optimizer",
    "new_member",
    "resolve_device",
    "save_checkpoint",
]


class Reporter(Protocol):
    """Receives each evaluation and, with an objective, its intermediate value (None
    without one); returns why the trial should stop (its owner's pruner said so), or None
    to go on."""

    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None: ...


@runtime_checkable
class StopListener(Protocol):
    """A reporter that can also tell, between evaluations, that its owner stopped the trial
    (workers/inbox.py: the runner's verdict on the last report); never waits."""

    def poll(self) -> str | None: ...


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
    """The learning-rate factor of step `step`: linear warmup, then constant, or a cosine
    from 1 down to the floor (`optim.min_lr / lr`, at most 1; 0.1 when `min_lr` is None)."""
    warmup, total, schedule = config.optim.warmup_steps, config.steps, config.optim.schedule
    o = config.optim
    floor = 0.1 if o.min_lr is None else min(1.0, o.min_lr / o.lr)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def make_optimizer(config: TrialConfig, model: QKModel) -> torch.optim.Optimizer:
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
        weight_decay=o.torch_weight_decay,  # independent decay: wd / lr (config_sections.py)
        betas=(o.beta1, o.beta2),
        fused=True if cuda else None,
        foreach=None if cuda else True,
    )


def build_model(config: TrialConfig, task: Task) -> QKModel:
    """The trial's model, initialised from the trial seed (in float64 for `dtype: float64`:
    drawn in float32 as always, then widened, so float32 and float64 trials of one seed
    start from the same weights)."""
    torch.manual_seed(config.seed)
    model = build(config.model, vocab_size=task.vocab_size, seq_len=task.seq_len)
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
    model: QKModel
    optimizer: torch.optim.Optimizer
    data_gen: torch.Generator
    probe_x: Tensor
    val_batches: list[tuple[Tensor, Tensor]]
    probe_targets: Tensor | None = None  # the answer's key position per probe query
    hist: History = field(default_factory=History.empty)
    start: int = 0  # the step this execution resumed from
    step: int = 0  # updates done
    n_evals: int = 0
    status: TrialStatus = TrialStatus.COMPLETED
    diverged_at: int | None = None
    admitted: float = 0.0  # perf_counter at admission: the member's own wall time
    summary: TrialSummary | None = None  # set when it has finished
    tag: Any = None  # the caller's handle (e.g. the trial number)
    stopper: Stopper | None = None  # the study's constraints, checked at every evaluation
    objective: str | None = None  # the summary whose intermediate value each report carries
    # the reporter's poll for a pruner's stop between evaluations (with an objective only)
    poll: Callable[[], str | None] | None = None
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
        poll=reporter.poll if objective and isinstance(reporter, StopListener) else None,
    )


def load_checkpoint(mem: Member, device: torch.device, restore_rng: bool) -> None:
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


def save_checkpoint(mem: Member) -> None:
    """Atomic and durable (workers/checkpoints.py, `durable_write`): written to
    `checkpoint.tmp`, fsynced, renamed over `checkpoint.pt`, then the directory fsynced, so a
    crash or a power loss leaves the previous checkpoint or the new one, whole. A failed write
    (a full disk) removes its `checkpoint.tmp` and raises; one left by a kill mid-write is
    removed when the directory is next claimed."""
    path = mem.checkpoint_path
    assert path is not None
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

    def write(f: IO[Any]) -> None:
        try:
            torch.save(state, f)
        except RuntimeError as e:
            # torch's zip writer reports a short write (a full disk, a file-size limit)
            # as RuntimeError("... unexpected pos ..."): a storage failure like any other
            if "unexpected pos" not in str(e):
                raise
            raise OSError(errno.ENOSPC, f"checkpoint write to {tmp} failed: {e}") from e

    durable_write(path, write, binary=True, tmp=tmp)
