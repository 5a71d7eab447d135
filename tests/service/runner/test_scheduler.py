"""The scheduler alone (no Ray, no database): placement by slot key, the status it owns, and
the ends it refuses because their sender no longer holds the trial.

Its pool here records what it was asked to do; the same scheduler runs against Ray's in
every service test (tests/service/test_slots.py, test_node_loss.py, ...).
"""

from __future__ import annotations

import math
from typing import Any

import optuna
import pytest

from service.runner.configs import slot_key
from service.runner.records import Status, TrialRecord
from service.runner.scheduler import Scheduler
from service.spec import StudySpec
from tests.workers.helpers import TINY
from workers.config import TrialConfig, TrialSummary
from workers.messages import Assignment, Batch, Failed, HandedBack, Report, Started, Stopped


class Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []

    def start(self, name: str, capacity: int, first: list[Assignment]) -> None:
        self.calls.append(("start", f"{name}x{capacity}", [a.trial for a in first]))

    def assign(self, name: str, items: list[Assignment]) -> None:
        self.calls.append(("assign", name, [a.trial for a in items]))

    def close(self, name: str) -> None:
        self.calls.append(("close", name, []))


def _scheduler(**over: Any) -> tuple[Scheduler, Recording, optuna.Study]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = StudySpec.model_validate(
        {"name": "s", "base": TINY, "budget": {"n_trials": 20}, "sampler": {"kind": "random"}}
        | over
    )
    pool = Recording()
    SPEC.append(spec)
    return Scheduler(spec, 3, pool), pool, optuna.create_study()


SPEC: list[StudySpec] = []


def _record(study: optuna.Study, **config: Any) -> TrialRecord:
    trial = study.ask()
    cfg = TrialConfig.model_validate({**TINY, **config})
    key, slots = slot_key(SPEC[-1], cfg, trial.number)
    return TrialRecord(trial, 100 + trial.number, {}, cfg, key=key, slots=slots)


def _stopped(worker: str, trial: int) -> Stopped:
    summary = TrialSummary(status="completed", steps_done=20)
    return Stopped(worker, trial, "e", summary, "node", 0.0, 1.0, 0)


def test_trials_fill_one_workers_slots_then_wait_for_a_free_one() -> None:
    sched, pool, study = _scheduler(fuse=4, parallelism=1)
    recs = [_record(study) for _ in range(5)]
    for r in recs:
        sched.add(r)
    sched.schedule()
    w = "study-3/worker-0"
    assert pool.calls == [("start", f"{w}x4", [0])] + [("assign", w, [n]) for n in (1, 2, 3)]
    assert [r.status for r in recs] == [Status.PLACED] * 4 + [Status.ASKED]
    assert sched.room() == 0 and sched.may_ask()  # random may look ahead up to 4 x 1
    assert sched.started(Started(w, 0, "e", "node", 1.0)) is recs[0]
    assert recs[0].status == Status.RUNNING and recs[0].starts == 1
    assert sched.ended(_stopped(w, 0)) is recs[0]  # its slot is free at once
    assert recs[0].status == Status.FINISHING and sched.finishing() == [recs[0]]
    sched.schedule()
    assert pool.calls[-1] == ("assign", w, [4]) and recs[4].worker == w
    sched.done(recs[0])
    assert recs[0].status == Status.DONE and 0 not in sched.records


def test_fixed_groups_take_no_new_trial_until_the_whole_group_has_ended() -> None:
    """`refill: false` (the comparison with HFTA/ModelBatch-style groups): a slot freed by
    a stopped member stays empty while the rest of its group trains; once the last member
    has ended, a whole new group enters. With `refill: true` the same end frees its slot
    at once (the test above)."""
    sched, pool, study = _scheduler(fuse=2, parallelism=1, refill=False)
    w = "study-3/worker-0"
    recs = [_record(study) for _ in range(4)]
    for r in recs:
        sched.add(r)
    sched.schedule()
    assert [r.worker for r in recs] == [w, w, None, None]
    sched.ended(_stopped(w, 0))
    sched.schedule()
    assert recs[2].status == Status.ASKED and sched.room() == 0  # the group trains on
    sched.ended(_stopped(w, 1))
    sched.schedule()
    assert recs[2].worker == w and recs[3].worker == w  # a new group of two
    assert pool.calls[-2:] == [("assign", w, [2]), ("assign", w, [3])]


def test_a_key_of_its_own_gets_its_own_worker() -> None:
    sched, pool, study = _scheduler(fuse=4, parallelism=2)
    a, b = _record(study), _record(study, model={**TINY["model"], "d_model": 64})
    c = _record(study)
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()
    assert [x[0] for x in pool.calls] == ["start", "start", "assign"]
    assert a.worker == c.worker != b.worker


def test_a_late_hand_back_from_a_worker_that_no_longer_holds_the_trial_changes_nothing() -> None:
    """The review's double-training race: a worker's end handled before its hand-backs
    put its members in a new worker; the old worker's late hand-backs must not take them
    out of the new one (before: looked up in every worker, requeued, placed a third time)."""
    sched, pool, study = _scheduler(fuse=2, parallelism=1, max_retries=2)
    a, b = _record(study), _record(study)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    w0 = "study-3/worker-0"
    assert sched.worker_ended(w0, "NodeDiedError") == []  # both wait again
    sched.schedule()
    w1 = "study-3/worker-1"
    assert a.worker == b.worker == w1
    n_calls = len(pool.calls)
    for r in (a, b):  # w0's hand-backs arrive now
        assert sched.ended(HandedBack(w0, r.number, 1)) is None
    assert a.worker == b.worker == w1 and a.status == b.status == Status.PLACED
    assert not sched.waiting and len(pool.calls) == n_calls  # nothing placed twice
    assert sched.ended(_stopped(w0, a.number)) is None  # a stale stop: also nothing
    assert sched.ended(Failed(w0, a.number, "late")) is None


def test_a_hand_back_lowers_the_senders_capacity_and_its_key_for_new_workers() -> None:
    sched, pool, study = _scheduler(fuse=4, parallelism=1)
    recs = [_record(study) for _ in range(3)]
    for r in recs:
        sched.add(r)
    sched.schedule()
    w0 = "study-3/worker-0"
    for r in recs:  # out of memory: all handed back, 2 would fit
        sched.ended(HandedBack(w0, r.number, 2))
    assert pool.calls[-1] == ("close", w0, [])  # empty after an out-of-memory: it exits
    assert [r.status for r in recs] == [Status.ASKED] * 3
    assert sched.worker_ended(w0, None) == []
    sched.schedule()
    assert pool.calls[-1][0] == "assign" and ("start", "study-3/worker-1x2", [2]) in pool.calls


def test_a_worker_that_keeps_dying_gives_its_trial_up_after_max_retries() -> None:
    """E.g. a worker that fails before it starts anything (a GPU node without CUDA): its
    trial is relaunched `max_retries` times, then fails with the worker's error, instead of
    being relaunched for ever (before: only started executions counted)."""
    sched, _pool, study = _scheduler(max_retries=2, fuse=1)
    rec = _record(study)
    sched.add(rec)
    for i in range(3):
        sched.schedule()
        assert rec.status == Status.PLACED
        given_up = sched.worker_ended(f"study-3/worker-{i}", "RuntimeError: CUDA is not available")
        if i < 2:
            assert given_up == [] and rec.status == Status.ASKED
    assert given_up == [(rec, "RuntimeError: CUDA is not available")]


def test_samplers_that_learn_never_ask_ahead() -> None:
    for sampler, fuse, ahead in (("tpe", 4, False), ("random", 4, True), ("random", 1, False)):
        sched, _pool, study = _scheduler(sampler={"kind": sampler}, fuse=fuse, parallelism=1)
        first = _record(study, model={**TINY["model"], "d_model": 64})
        sched.add(_record(study))
        sched.schedule()
        sched.add(first)  # another key: it waits for a worker of its own
        sched.schedule()
        assert sched.waiting and sched.may_ask() is ahead, sampler


@pytest.mark.parametrize("more", [True, False])
def test_idle_workers_are_closed_when_nothing_will_come(more: bool) -> None:
    sched, pool, study = _scheduler(fuse=2, parallelism=2)
    rec = _record(study)
    sched.add(rec)
    sched.schedule()
    sched.ended(_stopped(rec.worker or "", rec.number))
    sched.close_idle(more_to_ask=more)
    assert (pool.calls[-1][0] == "close") is (not more)


def test_a_worker_the_memory_monitor_killed_is_replaced_by_a_smaller_one() -> None:
    """Issue 27: Ray's memory monitor (host out of memory) killed a worker of three members;
    before, they were relaunched in a worker of the same size, to be killed again."""
    sched, pool, study = _scheduler(fuse=4, parallelism=1, max_retries=3)
    recs = [_record(study) for _ in range(3)]
    for r in recs:
        sched.add(r)
    sched.schedule()
    error = "OutOfMemoryError: Task was killed due to the node running low on memory."
    assert sched.worker_ended("study-3/worker-0", error, out_of_memory=True) == []
    sched.schedule()
    assert ("start", "study-3/worker-1x2", [0]) in pool.calls
    assert [r.status for r in recs] == [Status.PLACED, Status.PLACED, Status.ASKED]


def test_an_error_that_only_names_memory_does_not_shrink_the_worker() -> None:
    """The type of the error decides (service/runner/pool.py, `out_of_memory`), not its text:
    an error whose message merely mentions OutOfMemoryError relaunches the members in a
    worker of the same size."""
    sched, pool, study = _scheduler(fuse=4, parallelism=1, max_retries=3)
    recs = [_record(study) for _ in range(3)]
    for r in recs:
        sched.add(r)
    sched.schedule()
    error = "RayTaskError(RuntimeError): a log line that says OutOfMemoryError"
    assert sched.worker_ended("study-3/worker-0", error) == []
    sched.schedule()
    assert ("start", "study-3/worker-1x4", [0]) in pool.calls
    assert [r.status for r in recs] == [Status.PLACED] * 3  # all three in the new worker


def test_an_assignment_carries_the_runners_validated_config() -> None:
    """The worker trains the runner's `TrialConfig` as it comes (workers/messages.py,
    `Assignment`): the object itself, not a JSON copy to validate again."""
    sched, pool, study = _scheduler(fuse=2, parallelism=1)
    given: list[Assignment] = []
    pool.start = lambda name, capacity, first: given.extend(first)  # type: ignore[method-assign]
    rec = _record(study)
    sched.add(rec)
    sched.schedule()
    assert [a.trial for a in given] == [rec.number]
    assert isinstance(given[0].config, TrialConfig) and given[0].config is rec.config


@pytest.mark.parametrize(
    ("sampler", "fuse", "ramps"),
    [("tpe", "auto", True), ("gp", "auto", True), ("random", "auto", False), ("tpe", 4, False)],
)
def test_fuse_auto_ramps_up_under_samplers_that_learn(sampler: str, fuse: Any, ramps: bool) -> None:
    """Issue 25: one member per worker until results arrive, then one more per `parallelism`
    trials that left; random and an explicit `fuse` fill every slot at once."""
    sched, pool, study = _scheduler(sampler={"kind": sampler}, fuse=fuse, parallelism=2)
    slots = sched.spec.slots
    assert slots == 4  # the tiny config gains from fusion on a CPU
    recs = [_record(study) for _ in range(8)]
    for r in recs:
        sched.add(r)
    sched.schedule()
    held = {w.name: len(w.members) for w in sched.workers.values()}
    assert sorted(held.values()) == ([1, 1] if ramps else [4, 4]), held
    if not ramps:
        return
    assert sched.room() == 0 and [r.status for r in recs[2:]] == [Status.ASKED] * 6
    for done, want in ((1, [1, 1]), (2, [2, 2]), (4, [3, 3]), (6, [4, 4])):
        while sched.known < done:  # a member of the fullest worker ends and is recorded
            w = max(sched.workers.values(), key=lambda w: len(w.members))
            rec = sched.records[min(w.members)]
            assert sched.ended(_stopped(w.name, rec.number)) is rec
            sched.done(rec)
            sched.add(_record(study))
        sched.schedule()
        assert sorted(len(w.members) for w in sched.workers.values()) == want, done
    assert sched.depth() == slots


def test_a_relaunched_runner_ramps_from_the_results_the_study_has() -> None:
    spec = StudySpec.model_validate(
        {"name": "s", "base": TINY, "budget": {"n_trials": 20}, "parallelism": 2}
    )
    assert Scheduler(spec, 3, Recording(), known=0).depth() == 1
    assert Scheduler(spec, 3, Recording(), known=5).depth() == 3
    assert Scheduler(spec, 3, Recording(), known=50).depth() == 26  # a worker: min(capacity, depth)


@pytest.mark.parametrize(("direction", "told"), [("minimize", math.inf), ("maximize", -math.inf)])
def test_an_infinite_intermediate_value_is_told_as_the_objectives_worst(
    direction: str, told: float
) -> None:
    """A pruned objective that is a running maximum can be +inf after an overflow
    (docs/metrics.md section 9): the pruner is told the objective's worst value, as the final
    tell would be; a NaN is not told (Optuna refuses it). Before, every non-finite value was
    dropped, so the pruner never heard of the overflow."""
    sched, _, study = _scheduler(
        objectives=[{"metric": "max_attn_logit_ever", "direction": direction}],
        pruner={"kind": "median"},
    )
    rec = _record(study)
    sched.add(rec)
    sched.schedule()
    reports = [
        Report(rec.number, "e", 5, [], 3.0),
        Report(rec.number, "e", 10, [], math.inf),
        Report(rec.number, "e", 15, [], math.nan),
    ]
    out = sched.postprocess(Batch(reports=reports), [])
    assert [(step, v) for _, step, v in out.values] == [(5, 3.0), (10, told)]
