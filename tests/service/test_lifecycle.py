"""A trial's lifecycle in the runner, on real SQLite/PostgreSQL and Optuna's real RDBStorage
(no Ray: the runner's parts are driven directly, its pool records what it is asked): a
cancel that landed first is never overwritten by a late result; `last_step` never goes
backwards; a report that arrives after its trial finished is stored on its row (its
`metric_rows` recounted), never a crash; a retried ask adopts the trial the failed try
created instead of leaving it RUNNING for ever."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import func, select, update

from service.config import Settings
from service.runner.loop import StudyRunner
from service.runner.records import TrialRecord
from service.runner.reports import Reports
from service.runner.scheduler import Scheduler
from service.spec import StudySpec
from service.store import migrate
from service.store.models import Metric, Study, StudyStatus, Trial, TrialState, utcnow
from service.store.session import make_engine, make_sessionmaker, session_scope
from service.store.studies import StudyRows
from tests.service.helpers import small_quickstart
from workers.config import TrialSummary
from workers.messages import Assignment, Batch, Failed, Report, Started, Stopped


class NoRay:
    """The scheduler's pool with no Ray behind it: it records what it was asked to do."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []
        self.stopped: list[tuple[int, str]] = []  # (trial, reason) the pruner stopped
        self.said: list[tuple[str, Any]] = []  # stops and verdicts, in the order sent

    def start(self, name: str, capacity: int, first: list[Assignment]) -> None:
        self.calls.append(("start", name, [a.trial for a in first]))

    def assign(self, name: str, items: list[Assignment]) -> None:
        self.calls.append(("assign", name, [a.trial for a in items]))

    def close(self, name: str) -> None:
        self.calls.append(("close", name, []))

    def stop_trial(self, number: int, reason: str) -> None:
        self.stopped.append((number, reason))
        self.said.append(("stop", number))

    def judged(self, steps: dict[int, int]) -> None:
        self.said.append(("judged", dict(steps)))


def _runner(url: str, tmp_path: Path, **over: Any) -> StudyRunner:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    migrate.upgrade(url)
    engine = make_engine(url)
    spec = StudySpec.model_validate({**small_quickstart(), **over})
    row, _ = StudyRows(make_sessionmaker(engine)).create(spec)
    runner = StudyRunner(row.id, Settings(database_url=url, home=tmp_path), engine)
    pool = NoRay()
    runner.scheduler = Scheduler(runner.spec, runner.study_id, pool)
    runner.reports = Reports(
        runner.spec, runner.store.trials, runner.search, pool.stop_trial, pool.judged
    )
    return runner


def _launch(runner: StudyRunner) -> TrialRecord:
    runner._ask()
    rec = list(runner.scheduler.records.values())[-1]
    runner.scheduler.schedule()
    return rec


def _row(runner: StudyRunner, rec: TrialRecord) -> Trial:
    with session_scope(runner.store.sessions) as s:
        row = s.get(Trial, rec.row_id)
        assert row is not None
        s.expunge(row)
        return row


def _report(number: int, step: int, value: float) -> Report:
    return Report(number, "exec", step, [("val_loss", None, None, value)], value)


def _said(runner: StudyRunner, rec: TrialRecord, *reports: Report) -> None:
    """The loop's post-process of a batch in which `rec`'s worker started it (once) and
    sent `reports`: a started trial, so nothing asks Ray why a trial waits."""
    starts = [Started(rec.worker, rec.number, "exec", "n", 1.0)] if rec.worker else []
    runner._post_process(Batch(starts=starts, reports=list(reports)), [])


def _stopped(rec: TrialRecord, summary: dict[str, Any]) -> Stopped:
    assert rec.worker is not None
    return Stopped(
        rec.worker, rec.number, "exec", TrialSummary.model_validate(summary), "n", 1.0, 2.0, 0
    )


def test_a_cancel_that_landed_first_is_never_overwritten(db_url: str, tmp_path: Path) -> None:
    runner = _runner(db_url, tmp_path)
    rec = _launch(runner)
    with session_scope(runner.store.sessions) as s:
        s.execute(update(Trial).where(Trial.id == rec.row_id).values(state="CANCELLED"))
    summary = {"status": "completed", "steps_done": 40, "final_val_loss": 1.5, "eval_steps": [40]}
    assert runner.scheduler.ended(_stopped(rec, summary)) is rec
    runner._post_process(Batch(), [])
    assert runner.storage.get_trial(rec.trial._trial_id).state == OptunaState.RUNNING  # not told
    assert not runner.store.trials.record_failure(rec.row_id, "late failure", 1.0)
    row = _row(runner, rec)
    assert row.state == TrialState.CANCELLED and row.final_val_loss is None and row.error is None


def test_last_step_never_goes_backwards(db_url: str, tmp_path: Path) -> None:
    runner = _runner(db_url, tmp_path)
    rec = _launch(runner)
    _said(runner, rec, _report(rec.number, 40, 2.0))
    _said(runner, rec, _report(rec.number, 20, 2.5))  # a replay
    assert _row(runner, rec).last_step == 40
    _said(runner, rec, _report(rec.number, 60, 1.9))
    assert _row(runner, rec).last_step == 60


def test_a_report_after_the_trial_finished_is_stored_not_a_crash(
    db_url: str, tmp_path: Path
) -> None:
    runner = _runner(
        db_url, tmp_path, pruner={"kind": "median", "n_startup_trials": 0, "n_warmup_steps": 0}
    )
    told = _launch(runner)  # finished in Optuna while its report travelled
    runner.search.study.tell(told.trial, state=OptunaState.FAIL)
    _said(runner, told, _report(told.number, 20, 2.0))  # no raise
    assert runner.reports.stop_trial.__self__.stopped == []  # type: ignore[attr-defined]
    gone = _launch(runner)  # outcome recorded: the runner forgot it
    runner.scheduler.done(gone)
    _said(runner, gone, _report(gone.number, 20, 2.0))
    with session_scope(runner.store.sessions) as s:
        stored = s.scalar(select(func.count()).where(Metric.trial_id == gone.row_id))
    assert stored == 1  # issue 42: stored on its row, not dropped
    assert runner.reports.stop_trial.__self__.stopped == []  # type: ignore[attr-defined]


def _metric_count(runner: StudyRunner, rec: TrialRecord) -> int:
    with session_scope(runner.store.sessions) as s:
        return int(s.scalar(select(func.count()).where(Metric.trial_id == rec.row_id)) or 0)


def test_reports_later_than_the_flush_timeout_are_written_and_counted(
    db_url: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """Issue 42: Ray runs an async actor's calls out of order, so a trial's end can reach the
    runner before some of its reports. The runner waits FLUSH_TIMEOUT_S for them, records
    the outcome, and (before) dropped whatever came later: rows lost, `metric_rows` short of
    what the trial measured. Now they are stored on the trial's row and its `metric_rows`
    recounted; the recorded outcome and Optuna's trial are untouched."""
    from service.runner import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "FLUSH_TIMEOUT_S", 0.0)  # the wait, not its length
    runner = _runner(db_url, tmp_path)
    rec = _launch(runner)
    points = [("val_loss", None, None, 2.0), ("attn_entropy", 0, 0, 0.5)]
    reports = [Report(rec.number, "exec", step, points, 2.0) for step in (20, 40, 60)]
    _said(runner, rec, reports[0])  # one of three arrived
    summary = {"status": "completed", "steps_done": 60, "final_val_loss": 1.5, "eval_steps": [60]}
    end = Stopped(
        rec.worker or "", rec.number, "exec", TrialSummary.model_validate(summary), "n", 1.0, 2.0, 3
    )
    runner._post_process(Batch(ends=[end]), [])  # waited the flush timeout: recorded
    row = _row(runner, rec)
    assert row.state == TrialState.COMPLETE and row.metric_rows == 2 == _metric_count(runner, rec)
    told = runner.storage.get_trial(rec.trial._trial_id)
    assert told.state == OptunaState.COMPLETE
    runner._post_process(Batch(reports=reports[1:]), [])  # the late ones
    row = _row(runner, rec)
    assert _metric_count(runner, rec) == 6 and row.metric_rows == 6  # every row, counted
    assert row.state == TrialState.COMPLETE and row.final_val_loss == 1.5 and row.last_step == 60
    assert runner.storage.get_trial(rec.trial._trial_id).datetime_complete == told.datetime_complete
    runner._post_process(Batch(reports=reports[1:]), [])  # a replay: no-op
    assert _metric_count(runner, rec) == 6 and _row(runner, rec).metric_rows == 6


def test_the_pruner_gets_the_workers_value_and_its_stop_carries_the_reason(
    db_url: str, tmp_path: Path
) -> None:
    """#33: the runner hands Optuna's pruner the value a report carries (the worker computed
    it) and nothing else: a report without one is stored but not told, a replayed step is
    told once; a pruned trial is stopped with a reason naming the metric, value and step."""
    runner = _runner(
        db_url, tmp_path, pruner={"kind": "median", "n_startup_trials": 0, "n_warmup_steps": 0}
    )
    metric = runner.spec.objectives[0].metric
    good, bad = _launch(runner), _launch(runner)
    starts = [Started(r.worker or "", r.number, "exec", "n", 1.0) for r in (good, bad)]
    runner._post_process(Batch(starts=starts), [])  # both running: neither waits for Ray
    _said(runner, good, _report(good.number, 20, 1.0))
    runner.search.study.tell(good.trial, 1.0)
    silent = Report(bad.number, "exec", 10, [("val_loss", None, None, 9.0)])  # no value
    _said(runner, bad, silent, _report(bad.number, 20, 5.0))
    _said(runner, bad, _report(bad.number, 20, 5.0))  # a replay
    pool = runner.reports.stop_trial.__self__  # type: ignore[attr-defined]
    assert pool.stopped == [(bad.number, f"median pruner: {metric} 5 at step 20")]
    # every judged report answers its worker's verdict, the stop sent before it; a report
    # without a value, or a replay, is not judged again (nothing new to wait on)
    assert pool.said == [
        ("judged", {good.number: 20}),
        ("stop", bad.number),
        ("judged", {bad.number: 20}),
    ]
    frozen = runner.storage.get_trial(bad.trial._trial_id)
    assert frozen.intermediate_values == {20: 5.0}  # step 10 carried no value: not told
    with session_scope(runner.store.sessions) as s:
        steps = s.scalars(select(Metric.step).where(Metric.trial_id == bad.row_id)).all()
    assert sorted(steps) == [10, 20]  # every report stored, the replay once


def test_a_retried_ask_adopts_the_trial_the_failed_try_created(db_url: str, tmp_path: Path) -> None:
    runner = _runner(db_url, tmp_path)
    first = _launch(runner)
    orphan = runner.search.study.ask()  # created in Optuna, then the connection "dropped": no row
    runner._ask()
    assert max(runner.scheduler.records) == orphan.number
    trials = runner.search.study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == [first.number, orphan.number]  # no second ask
    with session_scope(runner.store.sessions) as s:
        numbers = s.scalars(select(Trial.number).where(Trial.study_id == runner.study_id)).all()
    assert sorted(numbers) == [first.number, orphan.number]
    runner._ask()  # nothing left to adopt: a new trial
    assert max(runner.scheduler.records) == orphan.number + 1


def test_a_slot_member_the_worker_could_not_train_fails_with_its_reason(
    db_url: str, tmp_path: Path
) -> None:
    """A slot worker's `Failed` end (out of memory with one slot) fails the trial at once:
    our row FAILED with the reason, Optuna told FAIL, the record gone (a late report of it
    is dropped)."""
    runner = _runner(db_url, tmp_path, fuse=4)
    rec = _launch(runner)
    reason = "OutOfMemoryError with one trial in the worker: CUDA out of memory"
    assert rec.worker is not None
    runner._post_process(Batch(ends=[Failed(rec.worker, rec.number, reason)]), [])
    row = _row(runner, rec)
    assert row.state == TrialState.FAILED and row.error == reason
    assert runner.storage.get_trial(rec.trial._trial_id).state == OptunaState.FAIL
    assert rec.number not in runner.scheduler.records and not runner.scheduler.finishing()


def test_the_time_budget_counts_from_the_studys_first_start(db_url: str, tmp_path: Path) -> None:
    """Issue 27 (10d): `budget.timeout_s` counted from each runner's start, so a study whose
    runner was relaunched got its whole time budget again. A relaunched runner of a study
    that started an hour ago with a 60 s budget asks nothing; one that started now asks."""
    runner = _runner(db_url, tmp_path, budget={"n_trials": 100, "timeout_s": 60})
    runner.store.studies.set_status(runner.study_id, StudyStatus.RUNNING)  # sets started_at
    first = runner._schedule(0, runner._started_at())
    assert 0 < first < 100  # within its time budget it asks (as many as there is room for)
    with session_scope(runner.store.sessions) as s:
        s.execute(
            update(Study)
            .where(Study.id == runner.study_id)
            .values(started_at=utcnow() - timedelta(hours=1))
        )
    later = StudyRunner(runner.study_id, runner.settings, make_engine(db_url))  # a relaunch
    later.scheduler = Scheduler(later.spec, later.study_id, NoRay())  # room again
    assert later.search.asked() == first
    assert later._schedule(first, later._started_at()) == first  # out of time: nothing more
