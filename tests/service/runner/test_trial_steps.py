"""A constraint given as `fraction_of_steps` is a fraction of the trial's own steps where the
study searches `steps` (issue 32 item 6): the rule its worker checks, the constraint values
the runner tells Optuna, and those a cancel or a give-up tells for recorded rows. Before,
all three took `base.steps`, so a 200-step trial was judged against a 40-step bound.

Real SQLite and PostgreSQL, Optuna's real storage; no Ray (nothing is trained)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.runner.loop import StudyRunner
from service.runner.results import judge
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.models import TrialState
from service.store.session import make_engine, make_sessionmaker
from service.store.trials import ResultRow, recorded_outcomes
from tests.workers.helpers import TINY
from workers.config import TrialSummary

BASE_STEPS, TRIAL_STEPS, FRACTION = 40, 200, 0.5


def _spec() -> StudySpec:
    return StudySpec.model_validate(
        {
            "name": "searched-steps",
            "base": {**TINY, "steps": BASE_STEPS},
            "search_space": {"steps": {"type": "categorical", "choices": [TRIAL_STEPS]}},
            "constraints": [{"metric": "plateau_steps", "op": "<=", "fraction_of_steps": FRACTION}],
            "budget": {"n_trials": 1},
            "fuse": 1,
        }
    )


@pytest.fixture
def runner(db_url: str, tmp_path: Path) -> Iterator[StudyRunner]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    store = Store(make_sessionmaker(engine))
    row, _ = store.studies.create(_spec())
    settings = Settings(database_url=db_url, home=tmp_path, checkpoint_dir=str(tmp_path / "c"))
    r = StudyRunner(row.id, settings, engine)
    yield r
    r.storage.engine.dispose()
    engine.dispose()


def test_fraction_of_steps_is_a_fraction_of_the_trials_own_steps(runner: StudyRunner) -> None:
    rec = runner._new_record(runner.search.ask((), lambda numbers: set()))
    assert rec is not None and rec.config is not None and rec.config.steps == TRIAL_STEPS
    # the worker's rule
    (rule,) = rec.stop_rules
    assert rule.bound == FRACTION * TRIAL_STEPS
    # what the runner records and tells: 80 plateau steps of 200 meet "at most half"
    plateau = 80
    summary = TrialSummary(status="completed", steps_done=TRIAL_STEPS, plateau_steps=plateau)
    judged = judge(runner.spec, summary, lambda: None, rec.config.steps)
    assert judged.constraints == [plateau - FRACTION * TRIAL_STEPS] and judged.feasible
    # what a cancel or a give-up tells Optuna for the recorded row
    row = ResultRow(
        state=TrialState.COMPLETE,
        summary=judged.summary,
        node=None,
        values=judged.values,
        feasible=judged.feasible,
        last_step=TRIAL_STEPS,
        started_at=None,
        finished_at=None,
        duration_s=1.0,
    )
    assert runner.store.trials.record_result(rec.row_id, row)
    _, outcomes = recorded_outcomes(runner.store.sessions, runner.study_id)
    assert outcomes[rec.number].constraints == [plateau - FRACTION * TRIAL_STEPS]
