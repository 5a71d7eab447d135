"""Standby runners on a real Ray head and a real database (service/control/standby.py,
service/runner/standby.py): a POST claims the warm standby, whose job runs the study in the
worker processes it warmed, under the job name a cold launch would have used; a standby is
started only while no study is live; a dead one is dropped, or, if a POST claimed it just
before it died, relaunched by the reconciler like any study whose job died; a retired one's
job ends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from service.app import create_app
from service.config import Settings
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.control.reconciler import reconcile
from service.control.standby import keep_standbys, retire_standbys
from service.store import Store, utcnow
from service.store.models import Study
from service.store.session import session_scope
from tests.service.helpers import small_quickstart, wait_until

# PostgreSQL: the standby contract in tests/service/store/test_standbys.py, both databases.
pytestmark = [pytest.mark.cluster, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


@pytest.fixture
def env(
    db_url: str, ray_head: LocalRayHead, tmp_path: Path
) -> Iterator[tuple[TestClient, Store, JobLauncher, Settings]]:
    """The API in process; the tests run the reconciler's rounds themselves."""
    settings = Settings(
        database_url=db_url,
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
        standby=1,
    )
    app = create_app(settings, reconcile_loop=False)
    with TestClient(app) as client:
        store: Store = app.state.store
        try:
            yield client, store, JobLauncher(ray_head.dashboard_url), settings
        finally:
            retire_standbys(store)


def _ready(store: Store) -> tuple[int, str]:
    """The one standby, once its runner says it is warm: (id, job id)."""

    def ready() -> tuple[int, str] | None:
        rows = store.standbys.listed()
        return (rows[0][0], str(rows[0][1])) if rows and rows[0][3] is not None else None

    out: tuple[int, str] = wait_until("a warm standby", ready, timeout=120)
    return out


def _job_status(launcher: JobLauncher, job_id: str) -> str | None:
    return launcher.status(job_id)


def _tasks_of(ray_head: LocalRayHead, launcher: JobLauncher, job_id: str) -> list[Any]:
    from ray.util.state import list_tasks

    ray_job = launcher._client.get_job_info(job_id).job_id
    return list(
        list_tasks(
            address=ray_head.dashboard_url,
            filters=[("job_id", "=", ray_job)],
            limit=1000,
            raise_on_missing_output=False,
            detail=True,
        )
    )


def test_a_post_runs_in_the_warm_standby(
    env: tuple[TestClient, Store, JobLauncher, Settings], ray_head: LocalRayHead
) -> None:
    client, store, launcher, settings = env
    assert keep_standbys(store, launcher, settings) == 1
    sid, job_id = _ready(store)
    assert job_id.startswith(f"qkscope-study-{sid}-a1-")
    jobs = {j.submission_id: j for j in launcher.list_jobs()}
    assert jobs[job_id].metadata["qkscope_study"] == str(sid)  # the dashboard's Jobs page
    # A standby is not a study: the API does not show it; /metrics counts it as ready.
    assert client.get(f"/v1/studies/{sid}").status_code == 404
    assert sid not in [s["id"] for s in client.get("/v1/studies").json()["items"]]
    assert 'qkscope_standby_runners{state="ready"} 1.0' in client.get("/metrics").text
    assert keep_standbys(store, launcher, settings) == 0  # one is enough

    r = client.post("/v1/studies", json=small_quickstart(n_trials=2, steps=20))
    assert r.status_code == 201, r.text
    study = r.json()
    assert study["id"] == sid and study["ray_job_id"] == job_id  # claimed: its job runs it
    assert keep_standbys(store, launcher, settings) == 0  # never while a study is live
    assert store.standbys.listed() == []

    def ended() -> dict[str, Any] | None:
        s: dict[str, Any] = client.get(f"/v1/studies/{sid}").json()
        return s if s["status"] in ("COMPLETED", "FAILED", "CANCELLED") else None

    final = wait_until("the study's end", ended, timeout=300)
    assert final["status"] == "COMPLETED", final["error"]
    trials = client.get(f"/v1/studies/{sid}/trials").json()["items"]
    assert len(trials) == 2 and {t["state"] for t in trials} == {"COMPLETE"}
    assert final["ray_job_id"] == job_id and store.studies.get(sid).job_attempts == 1  # type: ignore[union-attr]

    # Its first slot worker ran in a process the standby had warmed. (Ray's task events
    # arrive a little after the tasks: wait until they carry the worker's pid.)
    def pids() -> tuple[set[int], int] | None:
        tasks = _tasks_of(ray_head, launcher, job_id)
        warmed = {t.worker_pid for t in tasks if t.name == "warm_worker" and t.worker_pid}
        first = [t.worker_pid for t in tasks if t.name == f"study-{sid}/worker-0"]
        return (warmed, first[0]) if warmed and first and first[0] else None

    warmed, first = wait_until("the tasks' worker pids", pids, timeout=60)
    assert first in warmed, (first, warmed)

    # Idle again: a new standby is started for the next POST.
    assert keep_standbys(store, launcher, settings) == 1
    new_sid, new_job = _ready(store)
    assert new_sid > sid
    assert retire_standbys(store) == 1
    wait_until(
        "the retired standby's job to end",
        lambda: _job_status(launcher, new_job) == "SUCCEEDED",
        timeout=60,
    )
    assert store.studies.get(new_sid) is None


def test_a_standby_that_dies_is_dropped_or_relaunched_once_claimed(
    env: tuple[TestClient, Store, JobLauncher, Settings],
) -> None:
    client, store, launcher, settings = env
    # Not claimed: its row goes, and a new standby takes its place.
    keep_standbys(store, launcher, settings)
    dead, dead_job = _ready(store)
    launcher.stop(dead_job)
    wait_until(
        "job stopped", lambda: _job_status(launcher, dead_job) in ("STOPPED", "FAILED"), timeout=60
    )
    with session_scope(store.sessions) as s:  # as if it died just after its last heartbeat
        s.execute(update(Study).where(Study.id == dead).values(started_at=utcnow()))
    # Claimed in that window: the study has a dead job, which the reconciler relaunches.
    r = client.post("/v1/studies", json=small_quickstart(n_trials=1, steps=20))
    assert r.status_code == 201 and r.json()["id"] == dead
    t0 = time.monotonic()
    assert reconcile(store, launcher, settings) == 1  # at once: Ray says the job ended
    assert time.monotonic() - t0 < 30
    row = store.studies.get(dead)
    assert row is not None and row.job_attempts == 2 and row.ray_job_id != dead_job

    def completed() -> bool:
        return client.get(f"/v1/studies/{dead}").json()["status"] == "COMPLETED"

    wait_until("the relaunched study to complete", completed, timeout=300)

    # A standby that dies unclaimed is dropped (grace 0: judged at once) and replaced.
    keep_standbys(store, launcher, settings)
    _gone, gone_job = _ready(store)
    launcher.stop(gone_job)
    wait_until(
        "job stopped", lambda: _job_status(launcher, gone_job) in ("STOPPED", "FAILED"), timeout=60
    )
    assert keep_standbys(store, launcher, settings, grace_s=0) == 1
    rows = store.standbys.listed()  # (SQLite may give the new row the freed id again)
    assert len(rows) == 1 and rows[0][1] != gone_job
