"""A trial's lifecycle in the runner, on real SQLite/PostgreSQL and Optuna's real RDBStorage
(no Ray: the runner's parts are driven directly): a cancel that landed first is never
overwritten by a late result; `last_step` never goes backwards; a report that arrives after
its trial finished is dropped, never a crash; a retried ask adopts the trial the failed try
created instead of leaving it RUNNING for ever."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import func, select, update

from service.config import Settings
from service.db import migrate
from service.db.models import Metric, Trial, TrialState
from service.db.session import make_engine, make_sessionmaker, session_scope
from service.runner import StudyRunner
from service.spec import StudySpec
from service.studies import create_study
from service.trial_events import Running
from tests.service.test_e2e_ray import small_quickstart


def _runner(url: str, tmp_path: Path, **over: Any) -> StudyRunner:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    migrate.upgrade(url)
    engine = make_engine(url)
    spec = StudySpec.model_validate({**small_quickstart(), **over})
    row, _ = create_study(make_sessionmaker(engine), spec)
    return StudyRunner(row.id, Settings(database_url=url, home=tmp_path), engine)


def _launch(runner: StudyRunner) -> Running:
    planned = runner.source.ask(lambda: set())
    entry = Running(planned.trial, planned.row_id, planned.number, time.monotonic())
    runner.events.track(entry)
    return entry


def _row(runner: StudyRunner, entry: Running) -> Trial:
    with session_scope(runner.sessions) as s:
        row = s.get(Trial, entry.row_id)
        assert row is not None
        s.expunge(row)
        return row


def _report(number: int, step: int, value: float) -> tuple[int, int, Any, str]:
    return (number, step, [("val_loss", None, None, value)], "exec")


def test_a_cancel_that_landed_first_is_never_overwritten(db_url: str, tmp_path: Path) -> None:
    runner = _runner(db_url, tmp_path)
    entry = _launch(runner)
    with session_scope(runner.sessions) as s:
        s.execute(update(Trial).where(Trial.id == entry.row_id).values(state="CANCELLED"))
    summary = {"status": "completed", "steps_done": 40, "final_val_loss": 1.5, "eval_steps": [40]}
    runner.outcomes.finish(entry, {"summary": summary, "execution": "exec"})
    runner.outcomes.fail(entry, "late failure")
    row = _row(runner, entry)
    assert row.state == TrialState.CANCELLED and row.final_val_loss is None and row.error is None


def test_last_step_never_goes_backwards(db_url: str, tmp_path: Path) -> None:
    runner = _runner(db_url, tmp_path)
    entry = _launch(runner)
    runner.events.persist_reports([_report(entry.number, 40, 2.0)], inbox=None)
    runner.events.persist_reports([_report(entry.number, 20, 2.5)], inbox=None)  # a replay
    assert _row(runner, entry).last_step == 40
    runner.events.persist_reports([_report(entry.number, 60, 1.9)], inbox=None)
    assert _row(runner, entry).last_step == 60


def test_a_report_after_the_trial_finished_is_dropped_not_a_crash(
    db_url: str, tmp_path: Path
) -> None:
    runner = _runner(
        db_url, tmp_path, pruner={"kind": "median", "n_startup_trials": 0, "n_warmup_steps": 0}
    )
    told = _launch(runner)  # finished in Optuna while its report travelled
    runner.study.tell(told.trial, state=OptunaState.FAIL)
    runner.events.persist_reports([_report(told.number, 20, 2.0)], inbox=None)  # no raise
    gone = _launch(runner)  # outcome recorded: the runner forgot it
    runner.events.forget(gone.number)
    runner.events.persist_reports([_report(gone.number, 20, 2.0)], inbox=None)
    with session_scope(runner.sessions) as s:
        stored = s.scalar(select(func.count()).where(Metric.trial_id == gone.row_id))
    assert stored == 0


def test_a_retried_ask_adopts_the_trial_the_failed_try_created(db_url: str, tmp_path: Path) -> None:
    runner = _runner(db_url, tmp_path)
    first = _launch(runner)
    orphan = runner.study.ask()  # created in Optuna, then the connection "dropped": no row
    planned = runner.source.ask(lambda: {first.number})
    assert planned.number == orphan.number
    trials = runner.study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == [first.number, orphan.number]  # no second ask
    with session_scope(runner.sessions) as s:
        numbers = s.scalars(select(Trial.number).where(Trial.study_id == runner.study_id)).all()
    assert sorted(numbers) == [first.number, orphan.number]
    nxt = runner.source.ask(lambda: set())  # nothing left to adopt: a new trial
    assert nxt.number == orphan.number + 1


def test_a_slot_member_the_worker_could_not_train_fails_with_its_reason(
    db_url: str, tmp_path: Path
) -> None:
    """A slot worker's `failed` result (out of memory with one slot) fails the trial at once:
    our row FAILED with the reason, Optuna told FAIL, the trial out of the open registry (a
    late report of it is dropped)."""
    from service.slots import SlotPool

    runner = _runner(db_url, tmp_path, fuse=4)
    runner.pool = SlotPool(runner.spec, runner.study_id, inbox=None)
    entry = _launch(runner)
    reason = "OutOfMemoryError with one trial in the worker: CUDA out of memory"
    runner._on_finished([(entry.number, {"failed": reason})])
    row = _row(runner, entry)
    assert row.state == TrialState.FAILED and row.error == reason
    assert runner.storage.get_trial(entry.trial._trial_id).state == OptunaState.FAIL
    assert runner.events.entry(entry.number) is None and not runner.finishing
