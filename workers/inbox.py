"""The study runner's inbox: the one channel from slot workers to the runner, and back.

The runner owns one `TrialInbox` actor. Workers tell it when a member starts, send it every
evaluation and every member's end (workers/messages.py); the runner reads everything through
one streaming call (`TrialInbox.stream`) that yields a batch whenever something arrived. So
the database and Optuna live only in the runner process, a GPU node needs only `workers` and
Ray, and Ray's task list holds about one inbox call per evaluation per trial, never calls
that grow with wall time (no polling). The runner assigns trials and answers prune
questions through the same actor.

The trial path never blocks in `ray.get` / `ray.wait`: Ray lends the CPU/GPU of a task
blocked there to the next task, so a blocked trial would let more trials run than the
cluster has resources. Reports are fire-and-forget; the answer to a report (has the runner
decided to stop this trial?) is read from the report's future once it is done. Stop
decisions therefore arrive one or two evaluations late; that costs at most
`2 * eval_every` steps of a stopped trial and keeps training free of waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray

from workers.config import MetricPoint
from workers.messages import Assignment, Batch, End, Point, Report, Started

__all__ = ["ACK_TIMEOUT_S", "JOURNAL", "InboxReporter", "TrialInbox", "TrialInboxActor"]

JOURNAL = "reports.jsonl"
ACK_TIMEOUT_S = 120.0  # how long a finished worker waits for its last messages to arrive


class TrialInbox:
    """Buffers starts, reports and members' ends until the runner's stream takes them; holds
    stop decisions and the trials assigned to each slot worker. Runs as an async actor
    (`TrialInboxActor`): its methods never block each other."""

    def __init__(self) -> None:
        self._batch = Batch()
        self._yielded = 0  # batches the stream has yielded
        self._stop: set[int] = set()
        self._event = asyncio.Event()
        self._closed = False
        self._assigned: dict[str, list[Assignment]] = {}
        self._worker_events: dict[str, asyncio.Event] = {}
        self._closed_workers: set[str] = set()

    # ---- workers -> runner ------------------------------------------------------------------

    async def started(self, msg: Started) -> None:
        self._batch.starts.append(msg)
        self._event.set()

    async def put(self, msg: Report) -> bool:
        """Buffer one evaluation; answers whether the runner has decided to stop the trial."""
        self._batch.reports.append(msg)
        self._event.set()
        return msg.trial in self._stop

    async def ended(self, msg: End) -> None:
        """A member stopped, was handed back, or failed."""
        self._batch.ends.append(msg)
        self._event.set()

    # ---- runner -> workers ------------------------------------------------------------------

    async def stop(self, trial: int) -> None:
        """The runner's answer to the trial's next report: stop (pruned or infeasible)."""
        self._stop.add(trial)

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

    # ---- the runner's reading ---------------------------------------------------------------

    def _take(self) -> Batch:
        batch, self._batch = self._batch, Batch()
        return batch

    async def drain(self) -> Batch:
        """Everything buffered now (for callers that do not stream, e.g. benchmarks)."""
        return self._take()

    async def fence(self) -> tuple[Batch, int]:
        """Everything buffered now, and how many batches the stream has yielded before it:
        the runner that has taken that many from its stream has seen every message that
        reached the inbox before this call."""
        return self._take(), self._yielded

    async def stream(self) -> AsyncIterator[Batch]:
        """Yield a batch whenever something arrived, until `close()`.

        Call it once with `num_returns="streaming"`: one task for the study's whole life.
        """
        while True:
            await self._event.wait()
            self._event.clear()
            if self._batch:
                self._yielded += 1
                yield self._take()
            if self._closed:
                return

    async def close(self) -> None:
        self._closed = True
        self._event.set()


# The runner's actor (the class stays plain, so a test can subclass it to hold messages back).
TrialInboxActor = ray.remote(num_cpus=0)(TrialInbox)


class InboxReporter:
    """A `workers.engine.Reporter` that sends a member's evaluations to the inbox without
    waiting.

    With a journal (a file beside the trial's checkpoint, on storage every node reaches),
    each report is appended there before it is sent. Reports still in the inbox when the
    runner dies would otherwise be lost for good, because the trial resumes after its
    checkpoint and never repeats them; `replay()` sends the journal again and the metric
    primary key makes repeats no-ops.
    """

    def __init__(
        self, inbox: Any, trial: int, journal: Path | None = None, execution: str = ""
    ) -> None:
        self._inbox, self._trial, self._journal = inbox, trial, journal
        self.execution = execution
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._stop = False
        self.sent = 0

    def _send(self, step: int, points: list[Point]) -> None:
        ref = self._inbox.put.remote(Report(self._trial, self.execution, step, points))
        self._pending.append(ref.future())  # a callback, not a blocking ray.get
        self.sent += 1

    def _answers(self) -> bool:
        """Read the answers that have arrived (never waits); True once any said stop."""
        still: list[concurrent.futures.Future[Any]] = []
        for fut in self._pending:
            if not fut.done():
                still.append(fut)
            elif fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]  # the inbox is gone: fail loudly
            elif fut.result():
                self._stop = True
        self._pending = still
        return self._stop

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
        points: list[Point] = [(p.name, p.layer, p.head, p.value) for p in metrics]
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
        so none is still in flight when the worker ends; raises if the inbox is gone."""
        wait_acks(self._pending, timeout_s)
        self._pending = []


def wait_acks(futures: list[concurrent.futures.Future[Any]], timeout_s: float) -> None:
    """Wait until the inbox has executed these calls; raise if one failed or timed out."""
    done, not_done = concurrent.futures.wait(futures, timeout=timeout_s)
    for fut in done:
        if fut.exception() is not None:
            raise fut.exception()  # type: ignore[misc]
    if not_done:
        raise TimeoutError(f"{len(not_done)} messages not received by the inbox")
