"""A slot worker: the Ray task that trains a study's trials, 1..M at a time.

Every trial runs in a slot worker. A worker of one slot trains with the plain runner
(exactly `run_trial`); a worker of M > 1 slots trains its members as one fused model
(workers/fused.py). Each member has its own reporter, journal and checkpoint, reports and
ends on its own, and its slot takes the next trial the runner assigns while the others keep
training. A worker exits when the runner closes it and its last member has ended; before it
returns, the inbox has received every message it sent, so the runner that reads the inbox up
to the worker's end has seen all of them (workers/inbox.py, `TrialInbox.fence`).

What one member's trouble does: a config that cannot be built, a checkpoint that cannot be
read or written (a corrupt file, a full disk), its journal or stop record failing, or (alone
in the worker) an error in a step fails that member with its reason, and the worker goes on.
An out-of-memory (device or host) with several members hands them all back (each resumes
from its own checkpoint, in a worker with one slot fewer); alone, it fails the member. A
worker the host's memory monitor kills, or one that runs out of memory elsewhere (its task
then ends as `WorkerOutOfMemory`), is shrunk by the runner the same way, told by the
error's type.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import ray

from workers.checkpoints import claim_dir
from workers.config import TrialConfig
from workers.fusion_plan import slots_that_fit
from workers.inbox import ACK_TIMEOUT_S, JOURNAL, InboxReporter, wait_acks
from workers.messages import (
    Assignment,
    End,
    Failed,
    HandedBack,
    Started,
    Stopped,
    WorkerDone,
    WorkerOutOfMemory,
)

__all__ = ["SlotWorker", "check_gpus", "run_slot_worker_task"]


def check_gpus(gpu_ids: list[Any], node: str) -> None:
    """Fail loudly when Ray gave this worker GPUs that torch cannot use (a CPU build of
    torch, no driver): otherwise `device: auto` would quietly train on the CPU while Ray
    counts the GPUs as busy."""
    if not gpu_ids:
        return
    import torch

    if torch.cuda.is_available():
        return
    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}"
    raise RuntimeError(
        f"this trial asked for GPUs and Ray assigned it GPU ids {list(gpu_ids)} on {node}, "
        f"but CUDA is not available there ({build}). Run GPU workers from an image with CUDA "
        "torch (the Dockerfile's `gpu` target) on a node with a working NVIDIA driver."
    )


def node_name() -> str:
    return f"{socket.gethostname()}:{ray.get_runtime_context().get_node_id()[:12]}"


def _reporter(inbox: Any, trial: int, config: TrialConfig, execution: str) -> InboxReporter:
    """A member's reporter, journaling beside its checkpoint; the journal is replayed first
    (after the directory is claimed: a foreign run's journal is never replayed)."""
    ckpt_dir = config.checkpoint.dir
    claim_dir(ckpt_dir, config.checkpoint.owner)
    journal = Path(ckpt_dir) / JOURNAL if ckpt_dir else None
    reporter = InboxReporter(inbox, trial, journal, execution)
    reporter.replay()
    return reporter


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[-2000:]}"


class SlotWorker:
    """The worker side of a slot worker's life: admit assigned trials into free slots,
    train, and send each member's end the moment it happens. Never blocks the training
    loop: the next assignment is awaited on a future (`TrialInbox.take`) checked once per
    step, and only waited for when no member is left to train."""

    def __init__(self, worker: str, capacity: int, inbox: Any) -> None:
        self.worker, self.inbox, self.capacity = worker, inbox, capacity
        self.node = node_name()
        self.engine: Any = None  # a workers.engine.Engine, made with the first member's device
        self.device: Any = None
        self.reporters: dict[int, InboxReporter] = {}  # members training now
        self.all_reporters: list[InboxReporter] = []
        self.started: dict[int, float] = {}
        self.admitted = 0
        self.steps = 0  # member-steps trained by engines this worker has dropped
        self._sent: list[concurrent.futures.Future[Any]] = []

    # ---- messages ---------------------------------------------------------------------------

    def _end(self, msg: End) -> None:
        self.reporters.pop(msg.trial, None)
        self.started.pop(msg.trial, None)
        self._sent.append(self.inbox.ended.remote(msg).future())

    def _finished(self, mem: Any) -> None:
        """The engine's callback: a member stopped (its stop record is durable)."""
        trial = int(mem.tag)
        reporter, started = self.reporters[trial], self.started[trial]
        self._end(
            Stopped(
                self.worker,
                trial,
                reporter.execution,
                mem.summary,
                self.node,
                started,
                time.time(),
                reporter.sent,
            )
        )

    def _storage_failed(self, mem: Any, error: OSError) -> None:
        """The engine's callback: a member's own checkpoint, journal or stop record could not
        be written; it fails with the reason, its co-members train on."""
        self._end(Failed(self.worker, int(mem.tag), f"checkpoint storage: {_reason(error)}"))

    def _hand_back(self, trial: int) -> None:
        """Give a trial back to the runner untrained here, with this worker's slot count."""
        self._end(HandedBack(self.worker, trial, self.capacity))

    # ---- admission --------------------------------------------------------------------------

    def _start_engine(self, config: TrialConfig) -> None:
        # torch is imported by the worker process only, never by the runner
        from workers.engine import Engine
        from workers.fused import FusedRunner
        from workers.member import autocast_for, resolve_device
        from workers.runners import PlainRunner

        self.device = resolve_device(config)
        ctx = autocast_for(config, self.device)
        # One slot: the plain runner, exactly `run_trial`'s, which also trains the configs
        # the fused model refuses (dropout; a model that is not the built-in one), which get
        # one-slot workers.
        runner: PlainRunner | FusedRunner = (
            PlainRunner(ctx) if self.capacity == 1 else FusedRunner(self.capacity, self.device, ctx)
        )
        self.engine = Engine(
            runner, self.device, ctx, on_finish=self._finished, on_error=self._storage_failed
        )

    def admit(self, items: list[Assignment]) -> None:
        for item in items:
            if self.engine is not None and self.engine.free_slots <= 0:
                self._hand_back(item.trial)  # more than fits: the runner places it elsewhere
                continue
            try:
                self._admit(item)
            except Exception as e:  # this member's own trouble: it fails, the worker goes on
                if _is_oom(e):
                    raise
                self._end(Failed(self.worker, item.trial, _reason(e)))

    def _admit(self, item: Assignment) -> None:
        from workers.member import new_member

        config = item.config
        if self.engine is None:
            self._start_engine(config)
        execution = secrets.token_hex(6)
        self.started[item.trial] = time.time()
        msg = Started(self.worker, item.trial, execution, self.node, self.started[item.trial])
        self.inbox.started.remote(msg)
        reporter = _reporter(self.inbox, item.trial, config, execution)
        self.reporters[item.trial] = reporter
        self.all_reporters.append(reporter)
        self.admitted += 1
        member = new_member(
            config, reporter, self.device, item.trial, item.stop_rules, item.objective
        )
        if self.admitted == 1:
            self._fit_slots(member)
        self.engine.admit(member)

    def _fit_slots(self, member: Any) -> None:
        """On a GPU, as many slots as the memory estimate says fit in the free memory."""
        import torch

        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        fit = slots_that_fit(member.config, member.task.vocab_size, free, self.capacity)
        self.capacity = self.engine.runner.capacity = fit

    # ---- trouble in a step ----------------------------------------------------------------

    def _drop_engine(self) -> list[int]:
        """Forget the engine after an error in a step; returns the members it held."""
        import torch

        trials = list(self.reporters)  # training, or being admitted when it happened
        if self.engine is not None:
            self.steps += self.engine.steps_run
        self.engine = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return trials

    def on_out_of_memory(self, error: BaseException) -> None:
        """The device ran out of memory: hand every member back (each resumes from its own
        checkpoint, in a worker with one slot fewer) instead of failing them all. With one
        member there is nothing left to shrink: it fails with the error (a hand-back would
        only run out of memory again, for ever)."""
        trials = self._drop_engine()
        if len(trials) <= 1:
            reason = f"{type(error).__name__} with one trial in the worker: {str(error)[-1000:]}"
            for trial in trials:
                self._end(Failed(self.worker, trial, reason))
            return
        self.capacity = len(trials) - 1
        for trial in trials:
            self._hand_back(trial)

    def on_step_error(self, error: BaseException) -> None:
        """An error in the step of a lone member is that member's: it fails, the worker goes
        on. With several members nobody can tell whose it was: the worker fails (the runner
        relaunches its members up to `max_retries`)."""
        if len(self.reporters) > 1:
            raise error
        for trial in self._drop_engine():
            self._end(Failed(self.worker, trial, _reason(error)))

    # ---- the loop ----------------------------------------------------------------------------

    def run(self, first: list[Assignment]) -> WorkerDone:
        poll: concurrent.futures.Future[Any] | None = None
        closed = False
        if not self.admit_safely(first):
            return self._done()
        while True:
            busy = self.engine is not None and bool(self.engine.running)
            free = self.engine is None or self.engine.free_slots > 0
            if poll is None and free and not closed:
                poll = self.inbox.take.remote(self.worker).future()
            if poll is not None and (poll.done() or not busy):
                items = poll.result()  # waits only when no member is left to train
                poll = None
                if items is None:
                    closed = True
                elif not self.admit_safely(items):
                    break
                continue
            if not busy or not self.iterate_safely():
                break
        return self._done()

    def admit_safely(self, items: list[Assignment]) -> bool:
        """Admit; False after an out-of-memory (its members handed back: the worker ends,
        and the runner sizes its next worker by what fitted)."""
        try:
            self.admit(items)
        except Exception as e:
            if not _is_oom(e):
                raise
            self.on_out_of_memory(e)
            return False
        return True

    def iterate_safely(self) -> bool:
        """One engine iteration; False after an out-of-memory (as `admit_safely`)."""
        try:
            self.engine.iterate()
        except Exception as e:
            if _is_oom(e):
                self.on_out_of_memory(e)
                return False
            self.on_step_error(e)
        return True

    def _done(self) -> WorkerDone:
        """Wait until the inbox holds every report and end this worker sent, then say so."""
        self._settle()
        steps = self.steps + (self.engine.steps_run if self.engine is not None else 0)
        return WorkerDone(self.worker, self.node, self.admitted, steps)

    def _settle(self) -> None:
        for reporter in self.all_reporters:
            reporter.flush()
        wait_acks(self._sent, ACK_TIMEOUT_S)

    def run_settled(self, first: list[Assignment]) -> WorkerDone:
        """`run`, and on an error too, the task ends only after the inbox holds every message
        sent before it: the runner handles a worker's end after its last message, so a member
        that stopped before the error is recorded, never relaunched or failed. An
        out-of-memory that reaches here (outside an admission or a step, which hand the
        members back themselves) ends the task as `WorkerOutOfMemory`, the type the runner
        shrinks the worker's key on."""
        try:
            return self.run(first)
        except BaseException as e:
            with contextlib.suppress(Exception):  # the inbox may be what failed
                self._settle()
            if _is_oom(e) and not isinstance(e, WorkerOutOfMemory):
                raise WorkerOutOfMemory(_reason(e)) from e
            raise


# What a failed host allocation says (torch's CPU allocator raises a plain RuntimeError).
_HOST_OOM = ("DefaultCPUAllocator: can't allocate memory", "not enough memory")


def _is_oom(e: BaseException) -> bool:
    """Out of memory on the device or the host: the worker shrinks instead of failing all."""
    import torch

    if isinstance(e, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _HOST_OOM)


def run_slot_worker_task(
    worker: str, capacity: int, first: list[Assignment], inbox: Any
) -> WorkerDone:
    """Body of a slot worker's Ray task (named `study-<id>/worker-<k>` on the dashboard):
    up to `capacity` member slots, first `first`, then whatever the runner assigns through
    the inbox. Members whose checkpoint directory records a stop are finished without
    training (a relaunch, a runner restart)."""
    check_gpus(ray.get_gpu_ids(), node_name())
    return SlotWorker(worker, capacity, inbox).run_settled(first)
