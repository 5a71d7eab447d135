"""Ray glue for trials: the tasks a worker node runs and the inbox they report to.

`run_trial_task` runs one trial (`fuse: 1`); `run_slot_worker_task` is a fused worker
(`fuse > 1`, see workers/fused.py) that holds up to `fuse` member slots for its life: the runner
assigns it trials through the inbox, each member reports and finishes on its own (its row is
finished the moment it stops) and its slot takes the next assigned trial while the others
keep training. Every member has its own reporter, journal and checkpoint, so everything below
holds per member exactly as per single trial.

The study runner owns a `TrialInbox` actor. Each trial task tells it once that it
started and sends it every evaluation; the runner reads everything through one
streaming call (`TrialInbox.stream`) that yields a batch whenever something arrived.
So the database and Optuna live only in the runner process, a GPU node needs only
`workers` + Ray, and Ray's task list holds about one inbox call per evaluation per
trial, never calls that grow with wall time (no polling).

The trial path never blocks in `ray.get` / `ray.wait`: Ray lends the CPU/GPU of a
task blocked there to the next task, so a blocked trial would let more trials run
than the cluster has resources. Reports are fire-and-forget; the answer to a report
(has the runner decided to prune this trial?) is read from the report's future once
it is done. Prune decisions therefore arrive one or two evaluations late; that costs
at most `2 * eval_every` steps of a pruned trial and keeps training free of waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray

from workers.checkpoints import claim_dir
from workers.config import MetricPoint, TrialConfig, TrialSummary
from workers.fusion_plan import slots_that_fit

__all__ = [
    "Batch",
    "InboxReporter",
    "Assignment",
    "Finished",
    "Report",
    "Start",
    "TrialInbox",
    "check_gpus",
    "run_slot_worker_task",
    "run_trial_task",
]

Points = list[tuple[str, int | None, int | None, float]]
Report = tuple[int, int, Points, str]  # (trial, step, points, execution id)
JOURNAL = "reports.jsonl"
Start = tuple[int, str, float, str]  # (trial, node, unix time, execution id): a task began
Finished = tuple[int, dict[str, Any]]  # (trial, result): a slot member stopped
Assignment = tuple[dict[str, Any], int]  # (trial config, trial number) for a slot worker
Batch = tuple[list[Report], list[Start], list[Finished]]
ACK_TIMEOUT_S = 120.0  # how long a finished trial waits for its last reports to be received


@ray.remote(num_cpus=0)
class TrialInbox:
    """Buffers trial reports, starts and slot members' results until the runner's stream takes
    them; holds prune decisions and the trials assigned to each slot worker. An async actor:
    its methods never block each other."""

    def __init__(self) -> None:
        self._reports: list[Report] = []
        self._starts: list[Start] = []
        self._finished: list[Finished] = []
        self._prune: set[int] = set()
        self._event = asyncio.Event()
        self._closed = False
        self._assigned: dict[str, list[Assignment]] = {}
        self._worker_events: dict[str, asyncio.Event] = {}
        self._closed_workers: set[str] = set()

    async def started(self, trial: int, node: str, at: float, execution: str) -> None:
        self._starts.append((trial, node, at, execution))
        self._event.set()

    async def put(self, trial: int, step: int, points: Points, execution: str = "") -> bool:
        """Buffer one evaluation; answers whether the runner has decided to prune the trial."""
        self._reports.append((trial, step, points, execution))
        self._event.set()
        return trial in self._prune

    async def prune(self, trial: int) -> None:
        self._prune.add(trial)

    async def finished(self, trial: int, result: dict[str, Any]) -> None:
        """A slot member stopped (completed, pruned, diverged) or was handed back."""
        self._finished.append((trial, result))
        self._event.set()

    # ---- slot workers: the runner assigns, a worker takes -------------------------------------

    def _worker_event(self, worker: str) -> asyncio.Event:
        return self._worker_events.setdefault(worker, asyncio.Event())

    async def assign(self, worker: str, items: list[Assignment]) -> None:
        self._assigned.setdefault(worker, []).extend(items)
        self._worker_event(worker).set()

    async def close_worker(self, worker: str) -> None:
        """No more trials for this worker: it exits once its members have finished."""
        self._closed_workers.add(worker)
        self._worker_event(worker).set()

    async def take(self, worker: str) -> list[Assignment] | None:
        """The trials assigned to `worker` (waits until there are some); None once it is
        closed and has nothing left to take. A worker calls it only with a slot free."""
        event = self._worker_event(worker)
        while True:
            items = self._assigned.pop(worker, [])
            if items:
                return items
            if worker in self._closed_workers:
                return None
            event.clear()
            await event.wait()

    def _take(self) -> Batch:
        batch = (self._reports, self._starts, self._finished)
        self._reports, self._starts, self._finished = [], [], []
        return batch

    async def drain(self) -> Batch:
        """Everything buffered now (for callers that do not stream, e.g. benchmarks)."""
        return self._take()

    async def stream(self) -> AsyncIterator[Batch]:
        """Yield a batch whenever reports or starts arrived, until `close()`.

        Call it once with `num_returns="streaming"`: one task for the study's whole life.
        """
        while True:
            await self._event.wait()
            self._event.clear()
            if self._reports or self._starts or self._finished:
                yield self._take()
            if self._closed:
                return

    async def close(self) -> None:
        self._closed = True
        self._event.set()


class InboxReporter:
    """A `workers.trial.Reporter` that sends to a TrialInbox actor without waiting.

    With a journal (a file beside the trial's checkpoint, on storage every node
    reaches), each report is appended there before it is sent. Reports still in
    the inbox when the runner dies would otherwise be lost for good, because the
    trial resumes after its checkpoint and never repeats them; `replay()` sends
    the journal again and the metric primary key makes repeats no-ops.
    """

    def __init__(
        self, inbox: Any, trial: int, journal: Path | None = None, execution: str = ""
    ) -> None:
        self._inbox, self._trial, self._journal = inbox, trial, journal
        self._execution = execution
        self.execution = execution
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._pruned = False
        self.sent = 0

    def _send(self, step: int, points: Points) -> None:
        ref = self._inbox.put.remote(self._trial, step, points, self._execution)
        self._pending.append(ref.future())  # a callback, not a blocking ray.get
        self.sent += 1

    def _answers(self) -> bool:
        """Read the answers that have arrived (never waits); True once any said prune."""
        still: list[concurrent.futures.Future[Any]] = []
        for fut in self._pending:
            if not fut.done():
                still.append(fut)
            elif fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]  # the inbox is gone: fail loudly
            elif fut.result():
                self._pruned = True
        self._pending = still
        return self._pruned

    def replay(self) -> int:
        """Send every journaled report again; returns how many there were."""
        if self._journal is None or not self._journal.exists():
            return 0
        n = 0
        with self._journal.open() as f:
            for line in f:
                try:
                    step, points = json.loads(line)
                except ValueError:  # a line torn by a crash mid-write
                    continue
                self._send(int(step), [tuple(p) for p in points])
                n += 1
        return n

    def report(self, step: int, metrics: list[MetricPoint]) -> bool:
        points: Points = [(p.name, p.layer, p.head, p.value) for p in metrics]
        if self._journal is not None:
            self._journal.parent.mkdir(parents=True, exist_ok=True)
            with self._journal.open("a") as f:
                f.write(json.dumps([step, points]) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._send(step, points)
        return self._answers()

    def flush(self, timeout_s: float = ACK_TIMEOUT_S) -> None:
        """Wait (a plain thread wait, not `ray.get`) until the inbox holds every report sent,
        so none is still in flight when the task returns; raises if the inbox is gone."""
        done, not_done = concurrent.futures.wait(self._pending, timeout=timeout_s)
        for fut in done:
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        if not_done:
            raise TimeoutError(f"{len(not_done)} reports not received by the inbox")
        self._pending = []


def check_gpus(gpu_ids: list[Any], node: str) -> None:
    """Fail loudly when Ray gave this trial GPUs that torch cannot use (a CPU build of torch,
    no driver): otherwise `device: auto` would quietly train on the CPU while Ray counts the
    GPUs as busy."""
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


def _node() -> str:
    return f"{socket.gethostname()}:{ray.get_runtime_context().get_node_id()[:12]}"


def _reporter(inbox: Any, trial: int, config: TrialConfig, execution: str) -> InboxReporter:
    """A trial's reporter, journaling beside its checkpoint; the journal is replayed first
    (after the directory is claimed: a foreign run's journal is never replayed)."""
    ckpt_dir = config.checkpoint.dir
    claim_dir(ckpt_dir, config.checkpoint.owner)
    journal = Path(ckpt_dir) / JOURNAL if ckpt_dir else None
    reporter = InboxReporter(inbox, trial, journal, execution)
    reporter.replay()
    return reporter


def run_trial_task(config: dict[str, Any], trial: int, inbox: Any) -> dict[str, Any]:
    """Body of the Ray task: run (or resume from checkpoint) and return the summary.

    Each execution announces itself first (with its own start time), so a Ray retry
    after a lost node or a crashed worker is counted in the trial's `attempts` and the
    trial's `started_at` is when it really started, not when the runner asked Ray. The
    result says how many reports this execution sent, so the runner finishes the trial
    only after it has stored all of them.
    """
    from workers.trial import run_trial  # torch: only the trial process pays for it

    started = time.time()
    node = _node()
    execution = secrets.token_hex(6)
    inbox.started.remote(trial, node, started, execution)
    check_gpus(ray.get_gpu_ids(), node)
    parsed = TrialConfig.model_validate(config)
    reporter = _reporter(inbox, trial, parsed, execution)
    summary = run_trial(parsed, reporter)
    reporter.flush()
    return _result(summary, reporter, node, execution, started, time.time())


def _result(
    summary: TrialSummary,
    reporter: InboxReporter,
    node: str,
    execution: str,
    started: float,
    finished: float,
) -> dict[str, Any]:
    """What a trial task returns for one trial: its summary and where/when it ran."""
    return {
        "summary": summary.model_dump(mode="json"),
        "node": node,
        "pid": os.getpid(),
        "execution": execution,
        "reports_sent": reporter.sent,
        "started_at": started,
        "finished_at": finished,
    }


class _SlotWorker:
    """The worker side of a fused worker's life: admit assigned trials into free slots, train,
    and send each member's result the moment it stops. Never blocks the training loop: the
    next assignment is awaited on a future (`TrialInbox.take`) checked once per step, and only
    waited for when no member is left to train."""

    def __init__(self, worker: str, capacity: int, inbox: Any) -> None:
        self.worker, self.inbox, self.capacity = worker, inbox, capacity
        self.node = _node()
        self.engine: Any = None  # a workers.engine.Engine, made with the first member's device
        self.device: Any = None
        self.reporters: dict[int, InboxReporter] = {}  # members training now
        self.all_reporters: list[InboxReporter] = []
        self.started: dict[int, float] = {}
        self.admitted = 0

    def _start_engine(self, config: TrialConfig) -> None:
        # torch is imported by the worker process only, never by the runner
        from workers.engine import Engine, PlainRunner, autocast_for, resolve_device
        from workers.fused import FusedRunner

        self.device = resolve_device(config)
        ctx = autocast_for(config, self.device)
        # One slot: the plain runner, exactly `run_trial`'s, which also trains the configs
        # the fused model refuses (dropout, sigma-reparam) that get one-slot workers.
        runner: PlainRunner | FusedRunner = (
            PlainRunner(ctx) if self.capacity == 1 else FusedRunner(self.capacity, self.device, ctx)
        )
        self.engine = Engine(runner, self.device, ctx, on_finish=self._finished)

    def _finished(self, mem: Any) -> None:
        trial = int(mem.tag)
        reporter = self.reporters.pop(trial)
        result = _result(
            mem.summary,
            reporter,
            self.node,
            reporter.execution,
            self.started.pop(trial),
            time.time(),
        )
        self.inbox.finished.remote(trial, result)

    def admit(self, items: list[Assignment]) -> None:
        from workers.engine import new_member

        for config_dict, trial in items:
            config = TrialConfig.model_validate(config_dict)
            if self.engine is not None and self.engine.free_slots <= 0:
                self._hand_back(trial)  # more than fits: the runner places it elsewhere
                continue
            if self.engine is None:
                self._start_engine(config)
            execution = secrets.token_hex(6)
            self.started[trial] = time.time()
            self.inbox.started.remote(trial, self.node, self.started[trial], execution)
            reporter = _reporter(self.inbox, trial, config, execution)
            self.reporters[trial] = reporter
            self.all_reporters.append(reporter)
            self.admitted += 1
            member = new_member(config, reporter, self.device, tag=trial)
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

    def _hand_back(self, trial: int) -> None:
        """Give a trial back to the runner untrained here, with this worker's slot count."""
        self.reporters.pop(trial, None)
        self.started.pop(trial, None)
        self.inbox.finished.remote(trial, {"returned": True, "slots": self.capacity})

    def on_out_of_memory(self, error: BaseException) -> None:
        """The device ran out of memory: hand every member back (each resumes from its own
        checkpoint, in a worker with one slot fewer) instead of failing them all. With one
        member there is nothing left to shrink: it fails with the error (a hand-back would
        only run out of memory again, for ever)."""
        import torch

        trials = list(self.reporters)  # training, or being admitted when it happened
        self.engine = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(trials) <= 1:
            reason = f"{type(error).__name__} with one trial in the worker: {str(error)[-1000:]}"
            for trial in trials:
                self.reporters.pop(trial, None)
                self.started.pop(trial, None)
                self.inbox.finished.remote(trial, {"failed": reason})
            return
        self.capacity = len(trials) - 1
        for trial in trials:
            self._hand_back(trial)

    def run(self, first: list[Assignment]) -> dict[str, Any]:
        import torch

        poll: concurrent.futures.Future[Any] | None = None
        closed = False
        try:
            self.admit(first)
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
                    else:
                        self.admit(items)
                    continue
                if not busy:
                    break
                self.engine.iterate()
        except torch.OutOfMemoryError as e:
            steps = self.engine.steps_run if self.engine is not None else 0
            self.on_out_of_memory(e)
            return self._done(steps)
        return self._done(self.engine.steps_run if self.engine is not None else 0)

    def _done(self, steps: int) -> dict[str, Any]:
        for reporter in self.all_reporters:
            reporter.flush()
        return {"worker": self.worker, "node": self.node, "members": self.admitted, "steps": steps}


def run_slot_worker_task(
    worker: str, capacity: int, first: list[Assignment], inbox: Any
) -> dict[str, Any]:
    """Body of the Ray task of a fused worker (`fuse > 1`): up to `capacity` member slots.

    Trains the trials assigned to `worker` (first `first`, then whatever the runner assigns
    through the inbox) as one fused model; each member announces its start, reports, and
    sends its result (`TrialInbox.finished`, the fields `run_trial_task` returns) the moment
    it stops, and its slot is free at once. Exits when the runner closes the worker and its
    last member has finished. Members whose checkpoint directory records a stop are finished
    without training (a retry, a runner restart). Returns what the worker did.
    """
    check_gpus(ray.get_gpu_ids(), _node())
    return _SlotWorker(worker, capacity, inbox).run(first)
