"""Fused workers as slots: which trial trains in which worker, and where a slot is free.

With `fuse > 1` a study runs up to `parallelism` slot workers (Ray tasks running
`workers.remote.run_slot_worker_task`, named `study-<id>/worker-<k>` on the Ray dashboard),
each holding up to `fuse` member slots for trials of one fusion key (same architecture,
shapes and loop) for its whole life. A worker takes its next trial from the runner through
the inbox the moment a member stops, while its other members keep training. A config the
fused model refuses (dropout, sigma-reparam) gets a worker of one slot to itself, which
trains it with the plain runner, exactly as `fuse: 1` would.

The pool is the runner's book of that: it starts workers, assigns trials, frees a slot when
a member's result arrives, closes a worker when no more trials will come for it, and says
which members a worker held when it ended. It asks Optuna for nothing and writes nothing:
the runner does (service/runner.py). Ray does not retry a slot worker (its later members
arrived through the inbox, not its arguments); the runner places a lost worker's members in
any worker with a free slot of their key, and each resumes from its own checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from service.dispatch import Planned
from service.spec import StudySpec
from workers.config import TrialConfig
from workers.fusion_plan import FusionError, auto_fuse, check_fusable, fusion_key
from workers.remote import run_slot_worker_task

__all__ = ["SlotPool", "SlotWorker", "slot_key"]

_worker_task = ray.remote(run_slot_worker_task)


def slot_key(
    config: TrialConfig, number: int, auto_gpus: float | None = None
) -> tuple[str, int | None]:
    """The fusion key of a trial's config and the slots its worker gets (None = `fuse`);
    a config the fused model refuses gets a key (and a one-slot worker) of its own.

    With `fuse: auto` (`auto_gpus`: the study's GPUs per worker) each key gets what
    `auto_fuse` says its own config gains: a grid over depth holds keys whose steps cost 10x
    the base config's, where fusion on a CPU no longer pays (docs/reproductions.md, 4.1).
    """
    try:
        check_fusable(config)
    except FusionError:
        return f"alone:{number}", 1
    if auto_gpus is not None:
        return fusion_key(config), auto_fuse(config, auto_gpus)
    return fusion_key(config), None


@dataclass
class SlotWorker:
    """One fused worker as the runner sees it."""

    name: str
    key: str
    capacity: int
    ref: Any
    members: dict[int, Planned] = field(default_factory=dict)  # assigned, not finished
    closed: bool = False

    @property
    def free(self) -> int:
        return self.capacity - len(self.members)


class SlotPool:
    """The study's slot workers, by their Ray task."""

    def __init__(self, spec: StudySpec, study_id: int, inbox: Any) -> None:
        self.spec, self.study_id, self.inbox = spec, study_id, inbox
        self.workers: dict[Any, SlotWorker] = {}
        self.slots_for: dict[str, int] = {}  # a key's slot count a worker said fits
        self.auto_gpus = spec.resources.gpus if spec.fuse == "auto" else None
        self._serial = 0

    def room(self) -> int:
        """Slots a new trial could take now: free ones in open workers, and whole workers
        that may still be started."""
        free = sum(w.free for w in self.workers.values() if not w.closed)
        return free + (self.spec.parallelism - len(self.workers)) * self.spec.slots

    def place(self, planned: Planned, config: TrialConfig) -> bool:
        """Give the trial a slot: in an open worker of its key, else in a new worker; False
        when neither exists now (it waits for one)."""
        key, slots = slot_key(config, planned.number, self.auto_gpus)
        item = (config.model_dump(mode="json", by_alias=True), planned.number)
        for w in self.workers.values():
            if not w.closed and w.key == key and w.free > 0:
                self.inbox.assign.remote(w.name, [item])
                w.members[planned.number] = planned
                return True
        if len(self.workers) >= self.spec.parallelism:
            return False
        name = f"study-{self.study_id}/worker-{self._serial}"
        self._serial += 1
        capacity = min(slots or self.spec.slots, self.slots_for.get(key, self.spec.slots))
        res = self.spec.resources
        ref = _worker_task.options(
            name=name, num_cpus=res.cpus, num_gpus=res.gpus, max_retries=0
        ).remote(name, capacity, [item], self.inbox)
        self.workers[ref] = SlotWorker(name, key, capacity, ref, {planned.number: planned})
        return True

    def release(self, number: int, *, slots: int | None = None) -> Planned | None:
        """A member's slot is free (it finished). With `slots` the worker handed the trial
        back untrained (no slot fitted it, or the device ran out of memory): its key gets
        at most that many slots per worker from now on, this worker no more than it holds."""
        for w in self.workers.values():
            planned = w.members.pop(number, None)
            if planned is not None:
                if slots is not None:
                    self.slots_for[w.key] = min(slots, self.slots_for.get(w.key, slots))
                    w.capacity = min(w.capacity, max(len(w.members), 1), slots)
                    if not w.members:  # e.g. after an out-of-memory: it exits, no new trial
                        w.closed = True
                        self.inbox.close_worker.remote(w.name)
                return planned
        return None

    def ended(self, ref: Any) -> SlotWorker:
        """The worker's task returned or failed; it leaves the pool."""
        return self.workers.pop(ref)

    def close(self, *, keep_keys: set[str] | None = None, idle_only: bool = False) -> None:
        """Tell workers no more trials are coming: those without members (with `idle_only`)
        or all, except workers of `keep_keys`; each exits once its members have finished."""
        for w in self.workers.values():
            if w.closed or (keep_keys and w.key in keep_keys) or (idle_only and w.members):
                continue
            w.closed = True
            self.inbox.close_worker.remote(w.name)

    def refs(self) -> list[Any]:
        return list(self.workers)

    def members(self) -> list[Planned]:
        return [p for w in self.workers.values() for p in w.members.values()]
