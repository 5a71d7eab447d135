"""One runner per study whatever the job server does (issue 42, items 1 and 2): the launch
path and the reconciler run for real against the real store on SQLite and PostgreSQL; only
Ray's job server is an in-process stand-in (`StandInRay`, at the `JobLauncher` boundary).

Before: a connection reset after the job was sent was taken for a refusal and the claim
undone (`unclaim_launch` decremented `job_attempts`), so the next launch reused attempt n and
the fence admitted both runners; a runner that exited because the database was away
(exit 75) was charged one of `max_job_attempts`, so outages failed studies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from service.config import Settings
from service.control.launch import launch_study
from service.control.reconciler import reconcile
from service.spec import StudySpec
from service.store import EXIT_DATABASE_AWAY, Store, StudyStatus, migrate
from service.store.session import make_engine, make_sessionmaker
from tests.service.helpers import StandInRay, small_quickstart


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield Store(make_sessionmaker(engine))
    engine.dispose()


def _settings(db_url: str, tmp_path: Path, **kw: Any) -> Settings:
    return Settings(database_url=db_url, ray_address=StandInRay.address, home=tmp_path, **kw)


def _study(store: Store) -> int:
    row, _ = store.studies.create(StudySpec.model_validate(small_quickstart()))
    return row.id


def _state(store: Store, sid: int) -> tuple[str, int, str | None, int, int]:
    row = store.studies.get(sid)
    assert row is not None
    return row.status, row.job_attempts, row.ray_job_id, row.job_failures, row.weather_relaunches


def _round(store: Store, ray: StandInRay, settings: Settings) -> int:
    """One reconcile round, judged at once (no grace for a young study)."""
    return reconcile(store, cast(Any, ray), settings, grace_s=0)


def test_a_reset_after_the_job_was_sent_is_found_by_its_id_not_undone(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    settings = _settings(db_url, tmp_path)
    ray = StandInRay()
    sid = _study(store)
    ray.submit = "reset"  # Ray took the job; the answer was lost
    job = launch_study(store, cast(Any, ray), settings, sid, seen_attempts=0)
    assert job == f"{next(iter(ray.jobs))}" and job.startswith(f"qkscope-study-{sid}-a1-")
    assert _state(store, sid) == (StudyStatus.PENDING, 1, job, 0, 0)
    ray.submit = "ok"
    for _ in range(3):  # rounds while runner 1 lives: nothing to launch
        assert _round(store, ray, settings) == 0
    assert ray.attempts(sid) == [1] and len(ray.running(sid)) == 1
    ray.jobs[job].end(1)  # runner 1 dies: attempt 2, never attempt 1 again
    assert _round(store, ray, settings) == 1
    assert ray.attempts(sid) == [1, 2] and len(ray.running(sid)) == 1
    status, attempts, job2, failures, weather = _state(store, sid)
    assert (attempts, failures, weather) == (2, 1, 0) and job2 in ray.jobs
    assert ray.jobs[job2 or ""].attempt == 2


def test_a_refused_submission_keeps_its_attempt_spent_and_is_not_charged(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    settings = _settings(db_url, tmp_path, max_job_attempts=1)
    ray = StandInRay()
    sid = _study(store)
    ray.submit = "refused"
    with pytest.raises(Exception, match="refused"):
        launch_study(store, cast(Any, ray), settings, sid, seen_attempts=0)
    assert _state(store, sid) == (StudyStatus.PENDING, 1, None, 0, 0)  # Ray never had it
    assert _round(store, ray, settings) == 0  # still refused: tried again, not charged
    assert _state(store, sid) == (StudyStatus.PENDING, 2, None, 0, 0)
    ray.submit = "ok"
    assert _round(store, ray, settings) == 1  # max_job_attempts=1 and still launched
    assert ray.attempts(sid) == [3]
    assert _state(store, sid)[1:] == (3, next(iter(ray.jobs)), 0, 0)


def test_a_submission_ray_cannot_be_asked_about_stays_recorded(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    """The answer was lost and Ray does not answer the question either: the job id stays,
    and Ray's job list decides in a later round (here: it has the job, so nothing more is
    launched; a job it never had would be judged gone and relaunched as attempt 2)."""
    settings = _settings(db_url, tmp_path)
    ray = StandInRay()
    sid = _study(store)
    ray.submit, ray.lookup_down = "reset", True
    with pytest.raises(Exception, match="reset"):
        launch_study(store, cast(Any, ray), settings, sid, seen_attempts=0)
    (job,) = ray.jobs
    assert _state(store, sid) == (StudyStatus.PENDING, 1, job, 0, 0)
    ray.submit, ray.lookup_down = "ok", False
    assert _round(store, ray, settings) == 0
    assert ray.attempts(sid) == [1]


def test_a_database_exit_is_weather_waited_out_and_not_charged(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    settings = _settings(db_url, tmp_path, max_job_attempts=1, weather_relaunch_delay_s=60)
    ray = StandInRay()
    sid = _study(store)
    first = launch_study(store, cast(Any, ray), settings, sid, seen_attempts=0)
    assert first is not None
    ray.jobs[first].end(EXIT_DATABASE_AWAY)  # the runner waited out db_outage_s and left
    assert _round(store, ray, settings) == 0  # too soon: the database gets its while
    assert _state(store, sid) == (StudyStatus.PENDING, 1, first, 0, 0)
    ray.jobs[first].end(EXIT_DATABASE_AWAY, ago_s=61)
    assert _round(store, ray, settings) == 1  # relaunched although max_job_attempts is 1
    status, attempts, second, failures, weather = _state(store, sid)
    assert (status, attempts, failures, weather) == (StudyStatus.PENDING, 2, 0, 1)
    assert second is not None
    ray.jobs[second].end(1)  # a real failure is still charged: the one allowed
    assert _round(store, ray, settings) == 0
    row = store.studies.get(sid)
    assert row is not None and row.status == StudyStatus.FAILED
    assert "died 1 times" in (row.error or "") and ray.attempts(sid) == [1, 2]


def test_weather_has_its_own_bound(db_url: str, store: Store, tmp_path: Path) -> None:
    settings = _settings(db_url, tmp_path, max_weather_relaunches=1, weather_relaunch_delay_s=0)
    ray = StandInRay()
    sid = _study(store)
    for _ in range(2):
        job = store.studies.get(sid)
        if job is None or job.ray_job_id is None:
            launch_study(store, cast(Any, ray), settings, sid, seen_attempts=0)
        else:
            assert _round(store, ray, settings) == 1
        (running,) = ray.running(sid)
        running.end(EXIT_DATABASE_AWAY)
    assert _round(store, ray, settings) == 0
    row = store.studies.get(sid)
    assert row is not None and row.status == StudyStatus.FAILED
    assert "QKSCOPE_MAX_WEATHER_RELAUNCHES" in (row.error or "")
    assert (row.job_attempts, row.job_failures, row.weather_relaunches) == (2, 0, 1)
