"""The Ray side of the runner: the inbox, the slot workers' tasks, and waiting for either.

Slot workers are Ray tasks (`workers.slot_worker.run_slot_worker_task`, named
`study-<id>/worker-<k>` on the dashboard) that Ray never retries: a lost worker's trials
are the runner's to relaunch (service/runner/scheduler.py), each from its own checkpoint.
Everything a worker says arrives through one stream of inbox batches; `wait` returns them
together with the workers whose task ended, and reads the inbox up to each such end first
(`TrialInbox.fence`), so a worker's end is always handled after its last message.

However far the stream lags behind the inbox, a worker's end waits for it: it is held back
(the loop goes on: cancels, other workers) until the stream has delivered everything the
inbox had when the worker ended, never handed over early after a timeout. Handed over
early, the end of a member still on its way would have put that member back in the queue,
or failed it with `max_retries: 0`, although it had completed (issue 32 item 7). A lag past
`FENCE_TIMEOUT_S` is logged; a dead inbox ends the stream with an error instead.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.spec import MAX_FUSE, StudySpec
from workers.inbox import MAX_MESSAGES, STREAM_AHEAD, TrialInboxActor, max_concurrency
from workers.messages import Assignment, Batch, WorkerDone, WorkerOutOfMemory
from workers.slot_worker import run_slot_worker_task

__all__ = ["FENCE_TIMEOUT_S", "Ended", "RayPool", "make_inbox", "out_of_memory"]

log = logging.getLogger("qkscope.runner")
_worker_task = ray.remote(run_slot_worker_task)
FENCE_TIMEOUT_S = 60.0  # a stream that lags a worker's end longer than this is logged


@dataclass(frozen=True, slots=True)
class Ended:
    """A worker whose task ended: what it returned, or the error that ended it;
    `out_of_memory`: that error was a lack of memory (`out_of_memory`)."""

    name: str
    done: WorkerDone | None
    error: str | None
    out_of_memory: bool = False


def out_of_memory(error: BaseException) -> bool:
    """Whether a worker's task ended for lack of memory, by the error's type: Ray's memory
    monitor killed it (`ray.exceptions.OutOfMemoryError`), or the worker ran out of memory
    where it could not hand its members back itself (`WorkerOutOfMemory`, the cause of the
    `RayTaskError` that `ray.get` raises)."""
    if isinstance(error, ray.exceptions.OutOfMemoryError):
        return True
    cause = error.cause if isinstance(error, ray.exceptions.RayTaskError) else error
    return isinstance(cause, WorkerOutOfMemory)


def make_inbox(workers: int, max_messages: int = MAX_MESSAGES) -> Any:
    """A study's inbox actor, for up to `workers` slot workers. It lives on the runner's node:
    it shares the runner's fate, never a worker's. It holds at most `max_messages`
    (QKSCOPE_INBOX_MAX_MESSAGES); more wait for room."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    calls = max_concurrency(workers, MAX_FUSE)
    return TrialInboxActor.options(scheduling_strategy=here, max_concurrency=calls).remote(
        max_messages
    )


@dataclass(slots=True)
class _Fence:
    """Workers that ended, held back until the stream has yielded `upto` batches: then
    `pending` (what the inbox held at their end, newer than those batches) and they are
    handed over."""

    upto: int
    pending: Batch
    ended: list[Ended]
    since: float = field(default_factory=time.monotonic)
    warned: bool = False


class RayPool:
    """The study's inbox actor and slot-worker tasks (the scheduler's `Pool`)."""

    def __init__(
        self,
        spec: StudySpec,
        max_messages: int = MAX_MESSAGES,
        fence_timeout_s: float = FENCE_TIMEOUT_S,
        inbox: tuple[Any, int] | None = None,
    ) -> None:
        """`inbox`: an inbox actor made ahead (a standby's, `make_inbox`) and the parallelism
        it was made for; used when that covers the study's, else replaced by a new one."""
        self.spec = spec
        self.fence_timeout_s = fence_timeout_s
        if inbox is not None and inbox[1] >= spec.parallelism:
            self.inbox = inbox[0]
        else:
            if inbox is not None:
                ray.kill(inbox[0])
            self.inbox = make_inbox(spec.parallelism, max_messages)
        # One streaming call for the study's whole life: a batch whenever workers said
        # anything, at most STREAM_AHEAD of them waiting for this runner to read them.
        self._stream = self.inbox.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD
        ).remote()
        self._taken = 0  # batches taken from the stream
        self.refs: dict[Any, str] = {}  # a worker's task -> its name
        self._fences: deque[_Fence] = deque()  # ended workers the stream has not caught up to

    # ---- the scheduler's Pool --------------------------------------------------------------

    def start(self, name: str, capacity: int, first: list[Assignment]) -> None:
        res = self.spec.resources
        ref = _worker_task.options(
            name=name, num_cpus=res.cpus, num_gpus=res.gpus, max_retries=0
        ).remote(name, capacity, first, self.inbox)
        self.refs[ref] = name

    def assign(self, name: str, items: list[Assignment]) -> None:
        self.inbox.assign.remote(name, items)

    def close(self, name: str) -> None:
        self.inbox.close_worker.remote(name)

    # ---- waiting -------------------------------------------------------------------------------

    def stop_trial(self, number: int, reason: str) -> None:
        """The trial's next report is answered 'stop', with why (its pruner said so)."""
        self.inbox.stop.remote(number, reason)

    def judged(self, steps: dict[int, int]) -> None:
        """The pruner judged these trials' reports up to these steps: their workers' waiting
        verdicts are answered (after any stop sent before: one caller's calls run in order)."""
        self.inbox.judged.remote(steps)

    def wait(self, timeout_s: float) -> tuple[Batch, list[Ended]]:
        """Wait until workers said something or a worker's task ended (or `timeout_s`);
        returns every batch that arrived and the workers that ended, each after its last
        message. A worker whose messages the stream has not delivered yet is returned by a
        later call, once it has (up to `timeout_s` is spent waiting for it here)."""
        refs = list(self.refs)
        ray.wait([*refs, self._stream], num_returns=1, timeout=timeout_s)
        ended_refs = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        if ended_refs:
            # every message these workers sent is in the inbox (a task ends only then):
            # already yielded by the stream (the first `upto` batches) or still held there
            pending, yielded = ray.get(self.inbox.fence.remote())
            self._fences.append(_Fence(yielded, pending, [self._ended(r) for r in ended_refs]))
        return self._take(wait_s=timeout_s)

    def _take(self, wait_s: float) -> tuple[Batch, list[Ended]]:
        """The batches ready in the stream, in order, each fence's held messages and ended
        workers once the stream has caught up with it; waits up to `wait_s` for the stream
        while a fence is outstanding."""
        batch, ended = Batch(), []
        deadline = time.monotonic() + wait_s
        while True:
            while self._fences and self._fences[0].upto <= self._taken:
                fence = self._fences.popleft()
                batch.extend(fence.pending)
                ended += fence.ended
            wait = max(0.0, deadline - time.monotonic()) if self._fences else 0.0
            if not ray.wait([self._stream], num_returns=1, timeout=wait)[0]:
                break
            try:
                ref = next(self._stream)
            except StopIteration:
                break
            batch.extend(ray.get(ref))
            self._taken += 1
        self._warn_lag()
        return batch, ended

    def _warn_lag(self) -> None:
        for fence in self._fences:
            lag = time.monotonic() - fence.since
            if not fence.warned and lag >= self.fence_timeout_s:
                fence.warned = True
                log.warning(
                    "the inbox stream lags %.0f s behind the end of %s (%d of %d batches "
                    "taken); their trials wait for it",
                    lag,
                    ", ".join(e.name for e in fence.ended),
                    self._taken,
                    fence.upto,
                )

    def _ended(self, ref: Any) -> Ended:
        name = self.refs.pop(ref)
        try:
            return Ended(name, ray.get(ref), None)
        except Exception as e:
            return Ended(name, None, f"{type(e).__name__}: {str(e)[-2000:]}", out_of_memory(e))

    # ---- the end ---------------------------------------------------------------------------

    def cancel_all(self) -> None:
        for ref in self.refs:
            ray.cancel(ref, force=True)
        self.refs.clear()

    def close_inbox(self) -> None:
        self.inbox.close.remote()
