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
cluster has resources. Reports are fire-and-forget. A report that carries a value for the
pruner also asks for the runner's verdict on it (`TrialInbox.verdict`: a call the inbox
answers once the runner has judged that step); the worker looks at that future between
steps without waiting (`InboxReporter.poll`), so a pruned trial stops a few steps after
the runner's decision, as of the evaluation that was judged, instead of training on to its
next evaluation. The answer to each report (has the runner stopped this trial?) is the
fallback when a verdict takes longer than `VERDICT_TIMEOUT_S`.

Backpressure, so that a slow runner (a slow database) slows its workers instead of piling
messages up or losing them. The inbox buffers at most `max_messages` messages (starts,
reports and ends; QKSCOPE_INBOX_MAX_MESSAGES): a message that finds it full waits, in the
order it came, until the runner takes a batch, and its call returns only then. The runner's
stream lets at most `STREAM_AHEAD` batches wait for it (Ray's generator backpressure), so
the inbox is emptied only as fast as the runner reads. A reporter keeps at most
`IN_FLIGHT` reports unanswered: its next report waits (a plain thread wait on the futures,
not `ray.get`) for the oldest to be taken in. Nothing is dropped; the trial just trains
no faster than the runner stores what it measures.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray

from workers.config import MetricPoint
from workers.messages import Assignment, Batch, End, Point, Report, Started

__all__ = [
    "ACK_TIMEOUT_S",
    "IN_FLIGHT",
    "JOURNAL",
    "MAX_MESSAGES",
    "STREAM_AHEAD",
    "VERDICT_TIMEOUT_S",
    "InboxReporter",
    "TrialInbox",
    "TrialInboxActor",
    "max_concurrency",
]

JOURNAL = "reports.jsonl"
# How long a worker waits for the inbox to take in one more of its messages before it gives
# up on the inbox (a full inbox takes them in as fast as the runner reads: that is progress).
ACK_TIMEOUT_S = 120.0
MAX_MESSAGES = 1000  # the inbox's default bound (the runner passes QKSCOPE_INBOX_MAX_MESSAGES)
STREAM_AHEAD = 2  # batches the stream may yield before the runner has read them
IN_FLIGHT = 4  # reports one member may have sent and not yet had taken in
VERDICT_TIMEOUT_S = 10.0  # the longest the inbox holds a request for the runner's verdict


class TrialInbox:
    """Buffers starts, reports and members' ends until the runner's stream takes them; holds
    stop decisions and the trials assigned to each slot worker. Runs as an async actor
    (`TrialInboxActor`): its methods never block each other."""

    def __init__(self, max_messages: int = MAX_MESSAGES) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        self._max = max_messages
        self._held = 0  # messages in the buffer
        self._high_water = 0  # the most it ever held
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._batch = Batch()
        self._yielded = 0  # batches the stream has yielded
        self._stop: dict[int, str] = {}  # trial -> why the runner stopped it
        self._judged: dict[int, int] = {}  # trial -> the latest step the runner's pruner judged
        self._verdicts = asyncio.Event()  # set (and replaced) whenever a verdict is given
        self._event = asyncio.Event()
        self._closed = False
        self._assigned: dict[str, list[Assignment]] = {}
        self._worker_events: dict[str, asyncio.Event] = {}
        self._closed_workers: set[str] = set()

    # ---- workers -> runner ------------------------------------------------------------------

    async def _room(self) -> None:
        """Wait for a place in the buffer (first come, first served), and take it."""
        if self._held >= self._max or self._waiting:
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            await turn  # `_take` hands places out in order
        else:
            self._held += 1
        self._high_water = max(self._high_water, self._held)

    async def started(self, msg: Started) -> None:
        await self._room()
        self._batch.starts.append(msg)
        self._event.set()

    async def put(self, msg: Report) -> str | None:
        """Buffer one evaluation (waiting while the buffer is full); answers why the runner
        has decided to stop the trial, or None."""
        await self._room()
        self._batch.reports.append(msg)
        self._event.set()
        return self._stop.get(msg.trial)

    async def ended(self, msg: End) -> None:
        """A member stopped, was handed back, or failed."""
        await self._room()
        self._batch.ends.append(msg)
        self._event.set()

    async def stats(self) -> tuple[int, int, int, int]:
        """(messages held now, the most ever held, the bound, messages waiting for room)."""
        return self._held, self._high_water, self._max, len(self._waiting)

    # ---- runner -> workers ------------------------------------------------------------------

    async def stop(self, trial: int, reason: str) -> None:
        """The runner's answer to the trial's next report: stop (its pruner said so), and why."""
        self._stop.setdefault(trial, reason)
        self._wake()

    async def judged(self, steps: dict[int, int]) -> None:
        """The runner's pruner has judged these trials' reports up to these steps (a stop
        among them came first, through `stop`)."""
        for trial, step in steps.items():
            self._judged[trial] = max(self._judged.get(trial, -1), step)
        self._wake()

    async def verdict(
        self, trial: int, step: int, timeout_s: float = VERDICT_TIMEOUT_S
    ) -> str | None:
        """Once the runner has judged the trial's report at `step` (or stopped the trial):
        why it stopped it, or None. None too after `timeout_s` (a slow runner)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while trial not in self._stop and self._judged.get(trial, -1) < step:
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._verdicts.wait(), left)
            except TimeoutError:
                return None
        return self._stop.get(trial)

    def _wake(self) -> None:
        self._verdicts.set()  # every waiting verdict looks again, at the new event
        self._verdicts = asyncio.Event()

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
        self._held = 0
        while self._waiting and self._held < self._max:  # the next in line get the room
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled call gave its place up
                self._held += 1
                turn.set_result(None)
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


def max_concurrency(workers: int, slots: int) -> int:
    """Concurrent calls the inbox actor must run so that calls waiting for room never keep
    the runner's own calls (`fence`, `stop`, `assign`) from running: each member slot may
    have `IN_FLIGHT` reports, its start and its end waiting, and two verdicts (its own and
    one of the member it replaced, until that times out); each worker one `take`."""
    return max(1000, workers * slots * (IN_FLIGHT + 4) + workers + 64)


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
        self._stop: str | None = None  # why the runner stopped the trial, once an answer said
        self._verdict: concurrent.futures.Future[Any] | None = None  # the runner's, on a value
        self.sent = 0

    def _send(self, step: int, points: list[Point], value: float | None) -> None:
        self._answers()
        while len(self._pending) >= IN_FLIGHT:  # backpressure: the inbox is full
            concurrent.futures.wait(self._pending, return_when=concurrent.futures.FIRST_COMPLETED)
            self._answers()
        ref = self._inbox.put.remote(Report(self._trial, self.execution, step, points, value))
        self._pending.append(ref.future())  # a callback, not a blocking ray.get
        self.sent += 1
        if value is not None and (self._verdict is None or self._verdict.done()):
            # one request at a time: a slow runner's verdicts fall back to the answers
            self._verdict = self._inbox.verdict.remote(self._trial, step).future()

    def poll(self) -> str | None:
        """Why the runner stopped the trial, once a verdict or an answer said so; never
        waits (the engine asks between steps)."""
        verdict = self._verdict
        if self._stop is None and verdict is not None and verdict.done():
            self._verdict = None
            if verdict.exception() is None and verdict.result() is not None:
                self._stop = str(verdict.result())
        return self._answers()

    def _answers(self) -> str | None:
        """Read the answers that have arrived (never waits); the reason once any said stop."""
        still: list[concurrent.futures.Future[Any]] = []
        for fut in self._pending:
            if not fut.done():
                still.append(fut)
            elif fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]  # the inbox is gone: fail loudly
            elif fut.result() is not None and self._stop is None:
                self._stop = str(fut.result())
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
                    step, points, *rest = json.loads(line)  # rest: [value]
                except (ValueError, TypeError):  # a line torn by a crash mid-write
                    continue
                value = rest[0] if rest else None
                self._send(int(step), [tuple(p) for p in points], value)
                n += 1
        return n

    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None:
        points: list[Point] = [(p.name, p.layer, p.head, p.value) for p in metrics]
        if self._journal is not None:
            self._journal.parent.mkdir(parents=True, exist_ok=True)
            with self._journal.open("a") as f:
                f.write(json.dumps([step, points, value]) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._send(step, points, value)
        return self._answers()

    def flush(self, timeout_s: float = ACK_TIMEOUT_S) -> None:
        """Wait (a plain thread wait, not `ray.get`) until the inbox holds every report sent,
        so none is still in flight when the worker ends; raises if the inbox is gone."""
        wait_acks(self._pending, timeout_s)
        self._pending = []


def wait_acks(futures: list[concurrent.futures.Future[Any]], timeout_s: float) -> None:
    """Wait until the inbox has executed these calls; raise if one failed, or if none was
    taken in for `timeout_s` (a full inbox that the runner reads is slow, not stuck)."""
    pending = set(futures)
    while pending:
        done, pending = concurrent.futures.wait(
            pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
        )
        for fut in done:
            if fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        if not done:
            raise TimeoutError(f"{len(pending)} messages not received by the inbox")
