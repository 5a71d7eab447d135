"""A worker's end is handled only after every message it sent, however far the inbox's stream
lags (issue 32 item 7), through a real Ray head, a real inbox actor and a real worker task.

Before, the runner waited at most FENCE_TIMEOUT_S (60 s) for the stream to catch up with a
worker's end and then handled the end anyway: a member whose Stopped was still on its way
was put back in the queue as if its worker had lost it, or (with `max_retries: 0`) marked
FAILED, although it had completed. Here the stream holds each batch back 3 s and the wait is
shortened to 0.5 s by the pool's parameter, so the test takes seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import optuna
import pytest
import ray

from service.control.ray_cluster import LocalRayHead
from service.runner.configs import slot_key
from service.runner.pool import RayPool
from service.runner.records import Status, TrialRecord
from service.runner.scheduler import Scheduler
from service.spec import StudySpec
from tests.workers.helpers import TINY
from workers.config import TrialConfig, TrialSummary
from workers.inbox import InboxReporter, TrialInbox
from workers.messages import Assignment, Batch, WorkerDone
from workers.slot_worker import SlotWorker

pytestmark = pytest.mark.cluster

LAG_S = 3.0  # how long the stream holds each batch after counting it as yielded


def _lag_actors(lag_s: float) -> tuple[Any, Any]:
    """A lagging inbox and a worker whose member completes, made in a function so that Ray
    ships them by value (the test module is not importable in a Ray worker)."""

    class LaggingInbox(TrialInbox):
        """The real inbox, whose stream delivers each batch `lag_s` after it counted it as
        yielded (a loaded node, a busy runner): `fence` answers a count the runner has not
        reached yet."""

        async def stream(self) -> AsyncIterator[Batch]:
            async for batch in super().stream():
                await asyncio.sleep(lag_s)
                yield batch

    class CompletedMember:
        tag = 0
        summary = TrialSummary(status="completed", steps_done=20)

    class CompletesThenEnds(SlotWorker):
        """Its one member completes (the end is sent and acknowledged), then the task ends."""

        def run(self, first: list[Assignment]) -> WorkerDone:
            self.started[0] = time.time()
            self.reporters[0] = InboxReporter(self.inbox, 0)
            self._finished(CompletedMember())
            return self._done()

    def complete_then_end(name: str, inbox: Any) -> WorkerDone:
        return CompletesThenEnds(name, 1, inbox).run_settled([])

    return ray.remote(num_cpus=0)(LaggingInbox), ray.remote(num_cpus=0)(complete_then_end)


class _Placements:
    """The scheduler's pool without Ray: the test starts the worker's task itself."""

    def start(self, name: str, capacity: int, first: list[Assignment]) -> None: ...
    def assign(self, name: str, items: list[Assignment]) -> None: ...
    def close(self, name: str) -> None: ...


def test_a_completed_member_is_never_requeued_or_failed_because_its_end_was_slow(
    ray_head: LocalRayHead,
) -> None:
    ray.init(address=f"127.0.0.1:{ray_head.gcs_port}", log_to_driver=False)
    try:
        spec = StudySpec.model_validate(
            {"name": "lag", "base": TINY, "budget": {"n_trials": 1}, "fuse": 1, "max_retries": 0}
        )
        pool = RayPool(spec, fence_timeout_s=0.5)
        lagging, complete_then_end = _lag_actors(LAG_S)
        pool.inbox = lagging.remote()
        pool._stream = pool.inbox.stream.options(num_returns="streaming").remote()
        sched = Scheduler(spec, 1, _Placements())
        trial = optuna.create_study().ask()
        cfg = TrialConfig.model_validate(TINY)
        key, slots = slot_key(spec, cfg, trial.number)
        rec = TrialRecord(trial, trial.number, {}, cfg, key=key, slots=slots)
        sched.add(rec)
        sched.schedule()
        assert rec.worker is not None
        pool.refs[complete_then_end.remote(rec.worker, pool.inbox)] = rec.worker
        given_up: list[tuple[TrialRecord, str]] = []
        requeued = False
        deadline = time.monotonic() + 60
        # the runner's post-processing order: the batch's ends, then the workers that ended
        while sched.workers and time.monotonic() < deadline:
            batch, ended = pool.wait(1.0)
            for msg in batch.ends:
                sched.ended(msg)
            for e in ended:
                given_up += sched.worker_ended(e.name, e.error)
                requeued |= rec.status == Status.ASKED
        assert not sched.workers, "the worker's end never came"
        assert given_up == [] and not requeued
        assert rec.status == Status.FINISHING and rec.result is not None
        assert rec.result.summary.status == "completed"
        pool.close_inbox()
    finally:
        ray.shutdown()
