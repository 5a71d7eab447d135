"""The scheduler: which trial waits, which slot worker holds which trial, and every record's
status (it is the only code that changes one; see service/runner/records.py).

Its shape is a continuous-batching scheduler's: a waiting queue, the running workers, and a
budget (`parallelism` workers of up to `fuse` member slots each). `schedule` admits waiting
trials while slots allow, a slot is free the moment its member's end arrives, and a worker
that is no longer needed is closed. A trial goes only to a worker of its slot key
(`TrialRecord.key`). It starts no Ray task itself: the pool does (`Pool`).

Every end names its sender: an end from a worker that no longer holds the trial (it was
handed back and placed again, or its worker was given up for dead) changes nothing. The
runner hands a worker's end here only after every message the worker sent has been read.

`postprocess` is the one entry for what workers said (nano-vllm's `Scheduler.postprocess`
is the shape): it updates the records and returns typed `Outputs`, which the loop only
hands to the store and to the search.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.runner.configs import pruned_objective
from service.runner.records import Status, TrialRecord
from service.spec import HISTORY_FREE_SAMPLERS, StudySpec
from service.store import objective_values
from workers.messages import Assignment, Batch, End, Failed, HandedBack, Report, Started, Stopped

__all__ = ["FLUSH_TIMEOUT_S", "Outputs", "Pool", "Scheduler", "SlotWorker", "WorkerEnd"]

FLUSH_TIMEOUT_S = 60.0  # a finished trial waits at most this long for its last reports


class WorkerEnd(Protocol):
    """A slot worker's task ended (service/runner/pool.py: `Ended`); `error` is None when
    it ended on its own; `out_of_memory`: the error was a lack of memory (by its type)."""

    @property
    def name(self) -> str: ...
    @property
    def error(self) -> str | None: ...
    @property
    def out_of_memory(self) -> bool: ...


@dataclass(slots=True)
class Outputs:
    """What one `postprocess` leaves for the loop to write and to tell; the records are
    already updated."""

    starts: list[tuple[Started, TrialRecord]] = field(default_factory=list)  # accepted starts
    reports: list[tuple[Report, TrialRecord]] = field(default_factory=list)  # of held trials
    # (record, step, value) for the pruner: each step's first report with a finite value
    values: list[tuple[TrialRecord, int, float]] = field(default_factory=list)
    failed: list[tuple[TrialRecord, str]] = field(default_factory=list)  # fail, then `done`
    finished: list[TrialRecord] = field(default_factory=list)  # record, then `done`
    late: list[TrialRecord] = field(default_factory=list)  # of `finished`: reports missing
    # Reports of trials whose outcome is recorded already (they came more than
    # FLUSH_TIMEOUT_S after their end: Ray runs an async actor's calls out of order), with
    # the trial's row id: stored all the same, never dropped.
    after_end: list[tuple[Report, int]] = field(default_factory=list)


class Pool(Protocol):
    """Starts and talks to slot workers (service/runner/pool.py: Ray tasks and the inbox)."""

    def start(self, name: str, capacity: int, first: list[Assignment]) -> None: ...
    def assign(self, name: str, items: list[Assignment]) -> None: ...
    def close(self, name: str) -> None: ...


@dataclass(eq=False)
class SlotWorker:
    """One slot worker as the scheduler books it."""

    name: str
    key: str
    capacity: int
    members: set[int] = field(default_factory=set)  # trial numbers placed, not ended
    closed: bool = False
    sealed: bool = False  # `refill: false`: a member of its group ended; no new one enters


class Scheduler:
    """Records, the waiting queue and the slot workers of one study's runner."""

    def __init__(self, spec: StudySpec, study_id: int, pool: Pool, known: int = 0) -> None:
        self.spec, self.study_id, self.pool = spec, study_id, pool
        self.known = known  # trials of the study that have left (results, failures)
        self.records: dict[int, TrialRecord] = {}  # by trial number, until DONE
        self.waiting: deque[TrialRecord] = deque()
        self.workers: dict[str, SlotWorker] = {}
        self.slots_for: dict[str, int] = {}  # a key's slot count a worker said fits
        # row id of each trial this runner recorded an outcome of: where a report that comes
        # after it is stored (one int per trial, bounded by budget.n_trials)
        self.ended_rows: dict[int, int] = {}
        self._serial = 0

    # ---- admission ---------------------------------------------------------------------------

    def resume(self, records: list[TrialRecord], left: int) -> None:
        """A runner's start: the trials a dead runner left running wait first; `left`: the
        study's trials that have left already (results, failures), where the ramp of
        `depth` starts."""
        self.known = left
        for rec in records:
            self.add(rec)

    def add(self, rec: TrialRecord, *, front: bool = False) -> None:
        """A trial to run (asked, or resumed after a dead runner): it waits for a slot."""
        self.records[rec.number] = rec
        self._wait(rec, front)

    def _wait(self, rec: TrialRecord, front: bool) -> None:
        rec.status, rec.worker = Status.ASKED, None
        if front:
            self.waiting.appendleft(rec)
        else:
            self.waiting.append(rec)

    def depth(self) -> int:
        """Members a worker may hold now. Under `fuse: auto`, samplers that learn from
        results (TPE, GP, ...) ramp up: one member per worker at first, one more per
        `parallelism` trials that have left, so that the first results arrive after one
        trial's time rather than a fused batch's, and the trials in flight never outnumber
        by much the results the sampler proposes from (bench/README.md, "Time to a stable
        setting"). History-free samplers (random, grid) and an explicit `fuse: N` fill
        every slot at once."""
        if self.spec.fuse != "auto" or self.spec.sampler.kind in HISTORY_FREE_SAMPLERS:
            return self.spec.slots
        return 1 + self.known // self.spec.parallelism

    # ---- slot counts: decided here alone ---------------------------------------------------
    # `configs.slot_key` gives a key's most slots (the spec's `fuse`, or `auto`'s estimate);
    # `depth` the ramp; a worker that measured less room (handed back, out of memory) lowers
    # its key's count for every later worker of that key.

    def _capacity(self, key: str, slots: int) -> int:
        """Slots a new worker of `key` gets: the key's most, or fewer once one fitted less."""
        return min(slots, self.slots_for.get(key, slots))

    def _fits(self, key: str, n: int) -> None:
        """A worker of `key` found room for `n` members only."""
        self.slots_for[key] = min(n, self.slots_for.get(key, n))

    def _free(self, w: SlotWorker) -> int:
        if w.sealed:
            return 0
        return min(w.capacity, self.depth()) - len(w.members)

    def _member_left(self, w: SlotWorker) -> None:
        """Under `refill: false` a group that lost a member takes no new one until it has
        ended whole (fixed groups, for the comparison in bench/slots.py)."""
        if not self.spec.refill:
            w.sealed = bool(w.members)

    def room(self) -> int:
        """Slots a new trial could take now: free ones in open workers, and whole workers
        that may still be started."""
        free = sum(max(self._free(w), 0) for w in self.workers.values() if not w.closed)
        start = min(self.spec.slots, self.depth())
        return free + (self.spec.parallelism - len(self.workers)) * start

    def may_ask(self) -> bool:
        """Whether to ask for another trial now that the waiting ones are placed where they
        fit: only with nothing waiting, except for samplers whose proposals ignore results
        (random, grid), which may look ahead up to `slots x parallelism` trials so that
        workers fill with trials of their own architecture (asking ahead changes nothing
        such a sampler proposes)."""
        if not self.waiting:
            return True
        if self.spec.slots == 1 or self.spec.sampler.kind not in HISTORY_FREE_SAMPLERS:
            return False
        return len(self.waiting) < self.spec.slots * self.spec.parallelism

    def schedule(self) -> None:
        """Place waiting trials, in order, where a slot of their key is free or a worker
        may still be started; the others keep waiting."""
        for rec in list(self.waiting):
            assert rec.config is not None
            key, slots = rec.key, rec.slots
            item = Assignment(rec.number, rec.config, rec.stop_rules, pruned_objective(self.spec))
            worker = next(
                (
                    w
                    for w in self.workers.values()
                    if not w.closed and w.key == key and self._free(w) > 0
                ),
                None,
            )
            if worker is not None:
                self.pool.assign(worker.name, [item])
            elif len(self.workers) < self.spec.parallelism:
                name = f"study-{self.study_id}/worker-{self._serial}"
                self._serial += 1
                worker = SlotWorker(name, key, self._capacity(key, slots))
                self.workers[name] = worker
                self.pool.start(name, worker.capacity, [item])
            else:
                continue
            worker.members.add(rec.number)
            self.waiting.remove(rec)
            rec.status, rec.worker = Status.PLACED, worker.name

    def close_idle(self, more_to_ask: bool) -> None:
        """Workers that no trial will come to are told so (they exit when empty): all of
        them once nothing is left to ask; idle ones whose key no waiting trial has (so a
        worker of a waiting trial's key can start in their place)."""
        if more_to_ask and not self.waiting:
            return
        keep = {rec.key for rec in self.waiting}
        for w in self.workers.values():
            if w.closed or (self.waiting and (w.key in keep or w.members)):
                continue
            self._close(w)

    def _close(self, w: SlotWorker) -> None:
        w.closed = True
        self.pool.close(w.name)

    # ---- what workers say --------------------------------------------------------------------

    def _held(self, trial: int, worker: str) -> TrialRecord | None:
        """The trial's record if `worker` holds it now (else the message is stale)."""
        rec = self.records.get(trial)
        if rec is None or rec.worker != worker:
            return None
        return rec

    def started(self, msg: Started) -> TrialRecord | None:
        rec = self._held(msg.trial, msg.worker)
        if rec is None:
            return None
        rec.status = Status.RUNNING
        rec.starts += 1
        return rec

    def ended(self, msg: End) -> TrialRecord | None:
        """A member's end. Stopped: FINISHING, returned (record it once its reports are in);
        Failed: returned (record the failure, then `done`); handed back: it waits again,
        and the sender's key gets at most the slots it found room for."""
        rec = self._held(msg.trial, msg.worker)
        if rec is None:
            return None
        worker = self.workers[msg.worker]
        worker.members.discard(rec.number)
        if isinstance(msg, HandedBack):
            self._fits(worker.key, msg.slots)
            worker.capacity = min(worker.capacity, max(len(worker.members), 1), msg.slots)
            if not worker.members and not worker.closed:  # e.g. out of memory: it exits
                self._close(worker)
            self._wait(rec, front=True)
            return None
        self._member_left(worker)
        if isinstance(msg, Stopped):
            rec.status, rec.worker = Status.FINISHING, None
            rec.result, rec.finishing_since = msg, time.monotonic()
            return rec
        assert isinstance(msg, Failed)
        return rec

    def worker_ended(
        self, name: str, error: str | None, out_of_memory: bool = False
    ) -> list[tuple[TrialRecord, str]]:
        """A worker's task ended (every message it sent has been handed here). Members it
        still held wait for a slot again (each resumes from its checkpoint), except those
        lost with workers more than `max_retries` times (started or not: a worker that dies
        before it starts anything, e.g. on a node without the GPU it was given, must not
        relaunch its trials for ever): returned with the reason, to fail. `out_of_memory`:
        the error was a lack of memory (service/runner/pool.py, `out_of_memory`)."""
        worker = self.workers.pop(name)
        if out_of_memory and len(worker.members) > 1:
            # killed by the host's memory monitor (or out of memory where the worker could not
            # hand its members back) with several members: its key gets fewer slots, as a
            # worker that ran out of memory in a step would have handed them back
            self._fits(worker.key, len(worker.members) - 1)
        give_up: list[tuple[TrialRecord, str]] = []
        reason = error or "its worker ended without finishing it"
        for number in sorted(worker.members, reverse=True):  # the lowest number first in line
            rec = self.records[number]
            rec.losses += 1  # every loss counts: no trial is relaunched for ever
            if rec.losses > self.spec.max_retries:
                give_up.append((rec, reason))
            else:
                self._wait(rec, front=True)
        return give_up

    def postprocess(
        self, batch: Batch, ended: Sequence[WorkerEnd], *, force: bool = False
    ) -> Outputs:
        """Everything workers said since the last call, in order: starts, reports, members'
        ends, then workers' ends (each after its last message); then the finished trials
        whose reports are all in (or waited `FLUSH_TIMEOUT_S`, or `force`: a cancel)."""
        out = Outputs()
        out.starts = [(m, r) for m in batch.starts if (r := self.started(m)) is not None]
        for msg in batch.reports:
            rec = self.records.get(msg.trial)
            if rec is None:  # its outcome is recorded: a late report, stored on its row
                if (row_id := self.ended_rows.get(msg.trial)) is not None:
                    out.after_end.append((msg, row_id))
                continue
            rec.received[msg.execution] = rec.received.get(msg.execution, 0) + 1
            out.reports.append((msg, rec))
            v = msg.value
            if v is not None and not math.isnan(v) and msg.step not in rec.reported:
                rec.reported.add(msg.step)  # a replayed step is told once
                # +inf (a running maximum that overflowed): the objective's worst value, as
                # its final tell would be (Optuna takes infinities, never NaN)
                out.values.append((rec, msg.step, objective_values(self.spec, [v])[0]))
        for end in batch.ends:
            rec = self.ended(end)
            if rec is not None and isinstance(end, Failed):
                out.failed.append((rec, end.reason))
        for e in ended:
            out.failed += self.worker_ended(e.name, e.error, e.out_of_memory)
        now = time.monotonic()
        for rec in self.finishing():
            late = now - rec.finishing_since >= FLUSH_TIMEOUT_S
            if rec.reports_in() or late or force:
                out.finished.append(rec)
                if not rec.reports_in():
                    out.late.append(rec)
        return out

    # ---- outcomes ---------------------------------------------------------------------------

    def finishing(self) -> list[TrialRecord]:
        return [r for r in self.records.values() if r.status == Status.FINISHING]

    def done(self, rec: TrialRecord) -> None:
        """The trial's outcome is recorded: it leaves (a late end of it finds nothing; a late
        report of it is still stored, on its row: `Outputs.after_end`)."""
        rec.status, rec.worker = Status.DONE, None
        self.ended_rows[rec.number] = rec.row_id
        if self.records.pop(rec.number, None) is not None:
            self.known += 1
        if rec in self.waiting:
            self.waiting.remove(rec)

    def clear(self) -> list[int]:
        """Forget everything (a cancel); returns the row ids of the records it held."""
        rows = [r.row_id for r in self.records.values()]
        self.records.clear()
        self.waiting.clear()
        self.workers.clear()
        return rows

    # ---- views ---------------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.records or self.workers)

    def queued_rows(self) -> list[int]:
        """Row ids of trials that have not started anywhere yet."""
        return [r.row_id for r in self.records.values() if r.queued]
