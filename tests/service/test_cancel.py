"""One cancellation path, on real SQLite/PostgreSQL and Optuna's real RDBStorage: a cancel
finishes the study's unfinished trials in our table and in Optuna's storage, so a runner job
that died before it saw the cancel leaves no Optuna trial RUNNING; finished trials keep
their results in both."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import select

from service.control.cancel import cancel_study
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.models import Study, Trial, TrialState
from service.store.optuna import optuna_storage, optuna_study_name
from service.store.session import make_engine, make_sessionmaker, session_scope
from service.store.studies import StudyRows
from tests.service.helpers import small_quickstart


def seed(url: str) -> tuple[int, optuna.Study]:
    """A study whose (dead) runner asked three trials: one finished, one running, one queued."""
    migrate.upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    row, _ = StudyRows(sessions).create(StudySpec.model_validate(small_quickstart()))
    study = optuna.create_study(storage=optuna_storage(url), study_name=optuna_study_name(row.id))
    states = [TrialState.COMPLETE, TrialState.RUNNING, TrialState.QUEUED]
    with session_scope(sessions) as s:
        for number, state in enumerate(states):
            trial = study.ask()
            assert trial.number == number
            s.add(Trial(study_id=row.id, number=number, state=state, params={}))
            if state == TrialState.COMPLETE:
                study.tell(trial, 0.5)
    return row.id, study


def test_cancel_finishes_trials_in_both_stores(db_url: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sid, study = seed(db_url)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    # The runner job is gone (no launcher): nobody else will ever finish these trials.
    out = cancel_study(Store(sessions), None, sid, db_url)
    assert out is not None and out.status == "CANCELLED"
    with sessions() as s:
        rows = {t.number: t for t in s.scalars(select(Trial).where(Trial.study_id == sid))}
    assert rows[0].state == TrialState.COMPLETE and rows[0].error is None
    for n in (1, 2):
        assert rows[n].state == TrialState.CANCELLED
        assert rows[n].error == "study cancelled" and rows[n].finished_at is not None
    fresh = optuna.load_study(study_name=optuna_study_name(sid), storage=optuna_storage(db_url))
    by_number = {t.number: t for t in fresh.get_trials(deepcopy=False)}
    assert by_number[0].state == OptunaState.COMPLETE and by_number[0].value == 0.5
    for n in (1, 2):
        assert by_number[n].state == OptunaState.FAIL
        assert by_number[n].user_attrs["qkscope_status"] == "cancelled"
    # A second cancel changes nothing.
    assert cancel_study(Store(sessions), None, sid, db_url).status == "CANCELLED"  # type: ignore[union-attr]
    engine.dispose()


def test_cancel_of_a_study_never_launched(db_url: str) -> None:
    """No Optuna study exists yet: the cancel still works and touches nothing else."""
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    row, _ = StudyRows(sessions).create(StudySpec.model_validate(small_quickstart()))
    assert cancel_study(Store(sessions), None, row.id, db_url).status == "CANCELLED"  # type: ignore[union-attr]
    with sessions() as s:
        assert s.get(Study, row.id).status == "CANCELLED"  # type: ignore[union-attr]
    engine.dispose()
