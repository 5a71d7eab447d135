"""Ray glue for trials: the tasks a worker node runs and the inbox they report to.

`run_trial_task` runs one trial; `run_trial_group_task` runs a fused group (`fuse > 1`, see
workers/fused.py) with one reporter, journal and checkpoint per member, so everything below
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

from workers.config import MetricPoint, TrialConfig, TrialSummary

__all__ = [
    "Batch",
    "InboxReporter",
    "Report",
    "Start",
    "TrialInbox",
    "check_gpus",
    "run_trial_group_task",
    "run_trial_task",
]

Points = list[tuple[str, int | None, int | None, float]]
Report = tuple[int, int, Points, str]  # (trial, step, points, execution id)
JOURNAL = "reports.jsonl"
Start = tuple[int, str, float, str]  # (trial, node, unix time, execution id): a task began
Batch = tuple[list[Report], list[Start]]
ACK_TIMEOUT_S = 120.0  # how long a finished trial waits for its last reports to be received


@ray.remote(num_cpus=0)
class TrialInbox:
    """Buffers trial reports and starts until the runner's stream takes them; holds prune
    decisions. An async actor: its methods never block each other."""

    def __init__(self) -> None:
        self._reports: list[Report] = []
        self._starts: list[Start] = []
        self._prune: set[int] = set()
        self._event = asyncio.Event()
        self._closed = False

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

    def _take(self) -> Batch:
        batch = (self._reports, self._starts)
        self._reports, self._starts = [], []
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
            if self._reports or self._starts:
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
    """A trial's reporter, journaling beside its checkpoint; the journal is replayed first."""
    ckpt_dir = config.checkpoint.dir
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


def run_trial_group_task(
    configs: list[dict[str, Any]], trials: list[int], inbox: Any
) -> list[dict[str, Any]]:
    """Body of the Ray task of a fused group: `run_trial_task` for several trials at once.

    The members train as one fused model (`workers.fused.run_trial_group`); each keeps its
    own trial number, reporter, journal and checkpoint, so starts, reports, prune answers,
    retries and resumes work per member exactly as for a single trial (members of a retried
    group may resume at different steps). Returns one result per member, in order, with the
    fields `run_trial_task` returns.
    """
    from workers.fused import run_trial_group  # only fused tasks pay for the fused model

    if len(configs) != len(trials):
        raise ValueError(f"{len(configs)} configs but {len(trials)} trial numbers")
    started = time.time()
    node = _node()
    execution = secrets.token_hex(6)  # one execution of the group: shared by its members
    for trial in trials:
        inbox.started.remote(trial, node, started, execution)
    check_gpus(ray.get_gpu_ids(), node)
    parsed = [TrialConfig.model_validate(c) for c in configs]
    reporters = [_reporter(inbox, t, c, execution) for t, c in zip(trials, parsed, strict=True)]
    summaries = run_trial_group(parsed, reporters)
    for reporter in reporters:
        reporter.flush()
    finished = time.time()
    return [
        _result(summary, reporter, node, execution, started, finished)
        for summary, reporter in zip(summaries, reporters, strict=True)
    ]
