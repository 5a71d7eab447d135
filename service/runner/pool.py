"""The Ray side of the runner: the inbox, the slot workers' tasks, and waiting for either.

Slot workers are Ray tasks (`workers.slot_worker.run_slot_worker_task`, named
`study-<id>/worker-<k>` on the dashboard) that Ray never retries: a lost worker's trials
are the runner's to relaunch (service/runner/scheduler.py), each from its own checkpoint.
Everything a worker says arrives through one stream of inbox batches; `wait` returns them
together with the workers whose task ended, and reads the inbox up to each such end first
(`TrialInbox.fence`), so a worker's end is always handled after its last message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.spec import StudySpec
from workers.inbox import TrialInboxActor
from workers.messages import Assignment, Batch, WorkerDone
from workers.slot_worker import run_slot_worker_task

__all__ = ["FENCE_TIMEOUT_S", "Ended", "RayPool"]

_worker_task = ray.remote(run_slot_worker_task)
FENCE_TIMEOUT_S = 60.0  # how long the stream may lag the inbox at a worker's end


@dataclass(frozen=True, slots=True)
class Ended:
    """A worker whose task ended: what it returned, or the error that ended it."""

    name: str
    done: WorkerDone | None
    error: str | None


class RayPool:
    """The study's inbox actor and slot-worker tasks (the scheduler's `Pool`)."""

    def __init__(self, spec: StudySpec) -> None:
        self.spec = spec
        # The inbox lives on the runner's node: it shares the runner's fate, never a worker's.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        inbox: Any = TrialInboxActor.options(scheduling_strategy=here).remote()
        self.inbox = inbox
        # One streaming call for the study's whole life: a batch whenever workers said anything.
        self._stream = self.inbox.stream.options(num_returns="streaming").remote()
        self._taken = 0  # batches taken from the stream
        self.refs: dict[Any, str] = {}  # a worker's task -> its name

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

    def stop_trial(self, number: int) -> None:
        """The trial's next report is answered 'stop' (pruned, or infeasible)."""
        self.inbox.stop.remote(number)

    def wait(self, timeout_s: float) -> tuple[Batch, list[Ended]]:
        """Wait until workers said something or a worker's task ended (or `timeout_s`);
        returns every batch that arrived and the workers that ended, after their last
        messages."""
        refs = list(self.refs)
        ray.wait([*refs, self._stream], num_returns=1, timeout=timeout_s)
        ended_refs = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        batch = self._take(block=False)
        if ended_refs:
            batch.extend(self._fence())
        return batch, [self._ended(ref) for ref in ended_refs]

    def _take(self, block: bool, upto: int = 0, timeout_s: float = FENCE_TIMEOUT_S) -> Batch:
        """Batches ready in the stream (with `block`: until `upto` have been taken)."""
        batch = Batch()
        while True:
            need = block and self._taken < upto
            if not ray.wait([self._stream], num_returns=1, timeout=timeout_s if need else 0)[0]:
                return batch
            try:
                ref = next(self._stream)
            except StopIteration:
                return batch
            batch.extend(ray.get(ref))
            self._taken += 1

    def _fence(self) -> Batch:
        """Everything that reached the inbox until now: what the stream yielded before (it
        may still be on its way) and what it holds."""
        pending, yielded = ray.get(self.inbox.fence.remote())
        batch = self._take(block=True, upto=yielded)
        batch.extend(pending)
        return batch

    def _ended(self, ref: Any) -> Ended:
        name = self.refs.pop(ref)
        try:
            return Ended(name, ray.get(ref), None)
        except Exception as e:
            return Ended(name, None, f"{type(e).__name__}: {str(e)[-2000:]}")

    # ---- the end ---------------------------------------------------------------------------

    def cancel_all(self) -> None:
        for ref in self.refs:
            ray.cancel(ref, force=True)
        self.refs.clear()

    def close_inbox(self) -> None:
        self.inbox.close.remote()
