"""Two runner jobs for one study (issue 32, fencing), through a real Ray head and job server:
attempt 2 is launched while attempt 1's runner trains. Runner 1 meets its fence at its next
write and exits (its job FAILED with exit status 3, the study untouched by it), runner 2
finishes the study, and the finished study holds every planned trial once, with its metric
rows once and Optuna agreeing (tests/service/invariants.py).

Before fencing, both runners wrote the study: trials asked twice over the budget, results
recorded by one runner and relaunched by the other, the study marked COMPLETED by the runner
that finished first while the other still ran."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import select

from service.config import Settings
from service.control.launch import launch_study
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.runner.job import SUPERSEDED_EXIT
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.models import StudyStatus, Trial, TrialState
from service.store.session import make_engine, make_sessionmaker
from tests.service.invariants import check_finished_study, fault_spec

pytestmark = pytest.mark.cluster
T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T | None], timeout: float = 300) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := check()) is not None:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _launch(store: Store, launcher: JobLauncher, settings: Settings, sid: int) -> str:
    """Launch the study's next attempt; a job server that has just started may have no
    agent yet (a refusal: that attempt stays spent, never handed out again): try again,
    against the attempts the study has then."""

    def attempt() -> str | None:
        row = store.studies.get(sid)
        assert row is not None
        try:
            return launch_study(store, launcher, settings, sid, seen_attempts=row.job_attempts)
        except RuntimeError as e:
            if "No available agent" not in str(e):
                raise
            return None

    return wait_until("a job agent", attempt, timeout=120)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield Store(make_sessionmaker(engine))
    engine.dispose()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite: test_fencing.py
def test_a_second_runner_supersedes_the_first(
    db_url: str, store: Store, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    settings = Settings(
        database_url=db_url,
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    launcher = JobLauncher(ray_head.dashboard_url)
    row, _ = store.studies.create(StudySpec.model_validate(fault_spec(n_trials=2, steps=60)))
    sid = row.id
    first = _launch(store, launcher, settings, sid)

    def training() -> Any:
        with store.sessions() as s:
            steps = s.scalars(
                select(Trial.last_step).where(
                    Trial.study_id == sid, Trial.state == TrialState.RUNNING
                )
            ).all()
        return True if any(st >= 20 for st in steps) else None

    wait_until("runner 1 training", training)
    second = _launch(store, launcher, settings, sid)
    assert second != first  # attempt 2, while runner 1 runs

    client = launcher._client
    status = wait_until(
        "runner 1 to exit",
        lambda: (
            s if (s := str(client.get_job_status(first).value)) in ("FAILED", "SUCCEEDED") else None
        ),
    )
    logs = client.get_job_logs(first)
    assert status == "FAILED" and "superseded" in logs, logs[-2000:]
    assert client.get_job_info(first).driver_exit_code == SUPERSEDED_EXIT
    try:
        wait_until(
            "the study's end",
            lambda: True if store.studies.status(sid) != StudyStatus.RUNNING else None,
        )
    except AssertionError:
        with store.sessions() as s:
            rows = s.execute(
                select(Trial.number, Trial.state, Trial.last_step).where(Trial.study_id == sid)
            ).all()
        status2 = client.get_job_status(second).value
        raise AssertionError(
            f"runner 2 ({status2}), trials {rows}:\n{client.get_job_logs(second)[-3000:]}"
        ) from None
    check_finished_study(db_url, sid)  # every planned trial once, metric rows once, Optuna
    got = store.studies.get(sid)
    assert got is not None and got.ray_job_id == second
    assert f"-a{got.job_attempts}-" in second and f"-a{got.job_attempts}-" not in first
