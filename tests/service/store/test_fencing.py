"""Two runners for one study (issue 32 item 8): every write a runner makes is fenced by its
job attempt. Once the reconciler launched attempt 2, runner 1's writes change nothing and
raise `Superseded`, runner 2's go through; a stale runner never tells Optuna anything and
exits without marking the study FAILED. Real SQLite and PostgreSQL, Optuna's real storage;
no Ray (the stale runner meets its fence before it needs a worker).

Before, nothing checked the attempt: runner 1 went on ending trials, storing metric rows,
asking and telling Optuna, and could mark the study COMPLETED or FAILED under runner 2."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.control.ray_cluster import job_id_for
from service.runner.job import run_study
from service.runner.loop import StudyRunner
from service.runner.records import Status
from service.runner.reports import Reports
from service.runner.scheduler import Scheduler
from service.spec import StudySpec
from service.store import Fence, Store, Superseded, migrate
from service.store.models import Metric, Study, StudyStatus, Trial, TrialState
from service.store.optuna import optuna_storage, optuna_study_name
from service.store.session import make_engine, make_sessionmaker
from service.store.trials import ResultRow, StartRow
from tests.workers.helpers import TINY
from workers.config import TrialSummary
from workers.messages import Assignment, Batch, Stopped

SPEC = StudySpec.model_validate(
    {"name": "two-runners", "base": TINY, "budget": {"n_trials": 4}, "fuse": 1}
)


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield make_sessionmaker(engine)
    engine.dispose()


class Two:
    """A study launched twice: `old` is runner attempt 1's store, `new` attempt 2's."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        api = Store(sessions)
        row, _ = api.studies.create(SPEC)
        self.sid = row.id
        first, _ = api.studies.claim_launch(self.sid, None, job_id_for) or (0, "")
        assert first == 1
        self.old = Store(sessions, Fence(self.sid, first))
        self.old.studies.set_status(self.sid, StudyStatus.RUNNING)
        self.row = self.old.trials.insert_queued(self.sid, 0, {"seed": 0}, 0)
        self.old.trials.record_starts({self.row: StartRow("node-a", 1, time.time())})
        self.old.trials.store_reports([(self.row, 5, "val_loss", None, None, 2.0)])
        second, _ = api.studies.claim_launch(self.sid, first, job_id_for) or (0, "")
        assert second == 2  # the reconciler relaunched it
        self.new = Store(sessions, Fence(self.sid, second))

    def snapshot(self) -> tuple[Any, ...]:
        with self.sessions() as s:
            study = s.get(Study, self.sid)
            assert study is not None
            trials = s.execute(
                select(
                    Trial.number,
                    Trial.state,
                    Trial.attempts,
                    Trial.claimed_by,
                    Trial.last_step,
                    Trial.metric_rows,
                    Trial.node,
                    Trial.error,
                    Trial.waiting_reason,
                ).where(Trial.study_id == self.sid)
            ).all()
            metrics = s.scalar(select(func.count()).select_from(Metric))
            return (
                (study.status, study.error, study.waiting_reason, study.finished_at),
                (study.job_attempts, study.ray_job_id),
                sorted(tuple(t) for t in trials),
                metrics,
            )


def _result() -> ResultRow:
    return ResultRow(
        state=TrialState.COMPLETE,
        summary={"status": "completed", "steps_done": 10},
        node="node-a",
        values=[1.0],
        feasible=True,
        last_step=10,
        started_at=None,
        finished_at=None,
        duration_s=1.0,
    )


WRITES: dict[str, Callable[[Two, Store], object]] = {
    "set_status COMPLETED": lambda t, st: st.studies.set_status(t.sid, StudyStatus.COMPLETED),
    "fail_live": lambda t, st: st.studies.fail_live(t.sid, "a bug"),
    "set_waiting_reason": lambda t, st: st.studies.set_waiting_reason(t.sid, "why", [t.row]),
    "insert_queued": lambda t, st: st.trials.insert_queued(t.sid, 1, {"seed": 1}, 1),
    "claim_orphan": lambda t, st: st.trials.claim_orphan(t.sid, 0, st.fence.attempt),  # type: ignore[union-attr]
    "record_starts": lambda t, st: st.trials.record_starts({t.row: StartRow("b", 2, None)}),
    "store_reports": lambda t, st: st.trials.store_reports(
        [(t.row, 10, "val_loss", None, None, 1.5)]
    ),
    "record_result": lambda t, st: st.trials.record_result(t.row, _result()),
    "record_failure": lambda t, st: st.trials.record_failure(t.row, "lost", 1.0),
    "finish_open": lambda t, st: st.trials.finish_open(
        t.sid, TrialState.CANCELLED, "study cancelled", None
    ),
    "recount": lambda t, st: st.trials.recount([t.row]),
    "check_current": lambda t, st: st.studies.check_current(),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_stale_runners_write_changes_nothing_and_raises(
    sessions: sessionmaker[Session], write: str
) -> None:
    two = Two(sessions)
    before = two.snapshot()
    with pytest.raises(Superseded) as e:
        WRITES[write](two, two.old)
    assert (e.value.fence.attempt, e.value.current) == (1, 2)
    assert two.snapshot() == before
    WRITES[write](two, two.new)  # the current runner's goes through
    if write not in ("check_current", "recount"):  # (recount: only cancelled rows change)
        assert two.snapshot() != before


def test_the_apis_writes_are_not_fenced(sessions: sessionmaker[Session]) -> None:
    """A cancel (the API, the reconciler) is nobody's attempt: it always goes through."""
    two = Two(sessions)
    api = Store(sessions)
    api.studies.cancel(two.sid)
    assert api.trials.finish_open(two.sid, TrialState.CANCELLED, "study cancelled", None) == 1
    assert api.studies.status(two.sid) == StudyStatus.CANCELLED


# ---- the runner: Optuna hears nothing from a stale runner, and it exits cleanly -----------


class _NoPool:
    def start(self, name: str, capacity: int, first: list[Assignment]) -> None: ...
    def assign(self, name: str, items: list[Assignment]) -> None: ...
    def close(self, name: str) -> None: ...
    @staticmethod
    def stop(number: int, reason: str) -> None: ...


def _optuna_states(db_url: str, sid: int) -> list[str]:
    storage = optuna_storage(db_url)
    try:
        study = optuna.load_study(study_name=optuna_study_name(sid), storage=storage)
        return [t.state.name for t in study.get_trials(deepcopy=False)]
    finally:
        storage.engine.dispose()


def _attempt(claimed: tuple[int, str] | None) -> int | None:
    return None if claimed is None else claimed[0]


def _study(db_url: str) -> tuple[Store, int]:
    api = Store(make_sessionmaker(make_engine(db_url)))
    row, _ = api.studies.create(SPEC)
    assert _attempt(api.studies.claim_launch(row.id, None, job_id_for)) == 1
    return api, row.id


def test_a_stale_runner_tells_optuna_nothing(db_url: str, tmp_path: Path) -> None:
    migrate.upgrade(db_url)
    api, sid = _study(db_url)
    settings = Settings(database_url=db_url, home=tmp_path, checkpoint_dir=str(tmp_path / "c"))
    engine = make_engine(db_url)
    runner = StudyRunner(sid, settings, engine, attempt=1)
    try:
        runner.scheduler = Scheduler(runner.spec, sid, _NoPool())
        runner.reports = Reports(runner.spec, runner.store.trials, runner.search, _NoPool.stop)
        runner._ask()
        runner._ask()
        done, failing = runner.scheduler.records.values()
        # the first trial's worker says it completed; its result waits to be recorded
        summary = TrialSummary(status="completed", steps_done=20, final_val_loss=1.0)
        done.status, done.result = (
            Status.FINISHING,
            Stopped("w", done.number, "x", summary, "node", 0.0, 1.0, 0),
        )
        assert _optuna_states(db_url, sid) == ["RUNNING", "RUNNING"]
        assert _attempt(api.studies.claim_launch(sid, 1, job_id_for)) == 2  # attempt 2 takes over
        with pytest.raises(Superseded):
            runner._post_process(Batch(), [])
        with pytest.raises(Superseded):
            runner._fail(failing, "its worker was lost")
        with pytest.raises(Superseded):
            runner._ask()
        assert _optuna_states(db_url, sid) == ["RUNNING", "RUNNING"]  # told nothing, asked none
        with runner.store.sessions() as s:
            states = s.scalars(select(Trial.state).where(Trial.study_id == sid)).all()
        assert sorted(states) == ["QUEUED", "QUEUED"]  # both left for attempt 2
    finally:
        runner.storage.engine.dispose()
        engine.dispose()


def test_a_superseded_runner_exits_without_failing_the_study(db_url: str, tmp_path: Path) -> None:
    """The job of attempt 1 starts after attempt 2 was claimed (a submission whose answer
    was lost, then relaunched): it exits at its first write, leaves the study as it was and
    raises `Superseded` (`python -m service.runner` exits with status 3: the job FAILED,
    not the study). No Ray: it never gets as far as starting a worker."""
    migrate.upgrade(db_url)
    api, sid = _study(db_url)
    assert _attempt(api.studies.claim_launch(sid, 1, job_id_for)) == 2
    settings = Settings(database_url=db_url, home=tmp_path, checkpoint_dir=str(tmp_path / "c"))
    with pytest.raises(Superseded):
        run_study(sid, settings, attempt=1)
    row = api.studies.get(sid)
    assert row is not None
    assert (row.status, row.error, row.started_at, row.job_attempts) == (
        StudyStatus.PENDING,
        None,
        None,
        2,
    )
