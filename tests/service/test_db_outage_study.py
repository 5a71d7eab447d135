"""A fused study on a real Ray head whose PostgreSQL is cut off mid-run (issue 32).

The database sits behind a TCP proxy (tests/service/db_proxy.py) that closes every
connection and refuses new ones for a while; the API, its reconciler and the runner job all
reach PostgreSQL through it. Before: a cut longer than the runner's ~24 s of retries marked
the study FAILED for good. Now the runner waits `QKSCOPE_DB_OUTAGE_S` (shortened here) for
the database; past it, it exits leaving the study RUNNING and the reconciler relaunches it.
Either way the study COMPLETES with every trial once, every metric row there, nothing run
twice (tests/service/invariants.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.store import EXIT_DATABASE_AWAY, migrate
from tests.service.db_proxy import CuttableProxy
from tests.service.helpers import (
    assert_untouched,
    job_attempts,
    job_charges,
    settings_for,
    snapshot,
)
from tests.service.invariants import check_finished_study, fault_spec

pytestmark = [pytest.mark.cluster, pytest.mark.postgres]
STEPS = 240
CUT_S = 30.0  # longer than the old ~24 s of retries, shorter than twice that
# five times the window of the relaunch test: its runner exits while the database is away
LONG_CUT_S = 15.0


@pytest.fixture
def proxy(pg_db_url: str) -> Iterator[CuttableProxy]:
    migrate.upgrade(pg_db_url)
    p = CuttableProxy(pg_db_url)
    yield p
    p.close()


def _api(proxy: CuttableProxy, head: LocalRayHead, home: Path, outage_s: float) -> TestClient:
    """The API with its reconciler (every second), everything through the proxy."""
    settings = settings_for(
        proxy.url, head, home, db_outage_s=outage_s, weather_relaunch_delay_s=1.0
    )
    return TestClient(create_app(settings))


def _get(client: TestClient, path: str) -> Any:
    """A GET that waits out the 503s of a cut database (the API's answer while it is away)."""
    deadline = time.monotonic() + 120
    while True:
        r = client.get(path)
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 503 and r.headers["retry-after"], (path, r.status_code, r.text)
        assert time.monotonic() < deadline, "the database never came back"
        time.sleep(0.3)


def _until(what: str, cond: Any, timeout: float = 240, show: Any = None) -> Any:
    """Generous timeouts: a loaded machine starts Ray jobs slowly; timing never fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := cond():
            return out
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}: {show() if show else ''}")


def _mid_study(client: TestClient, sid: int) -> dict[str, Any] | None:
    """Once a trial is COMPLETE and another still RUNNING, far from its end."""
    trials = _get(client, f"/v1/studies/{sid}/trials?limit=100")["items"]
    done = [t for t in trials if t["state"] == "COMPLETE"]
    running = [t for t in trials if t["state"] == "RUNNING" and t["last_step"] < STEPS // 2]
    return {"done": done, "running": running} if done and running else None


def _trials(client: TestClient, sid: int) -> Any:
    study = _get(client, f"/v1/studies/{sid}")
    trials = _get(client, f"/v1/studies/{sid}/trials?limit=100")["items"]
    return study["status"], [(t["number"], t["state"], t["last_step"]) for t in trials]


def _spec() -> dict[str, Any]:
    """Six short trials in slot workers of two members each."""
    spec = fault_spec(n_trials=6, steps=STEPS)
    spec.update(fuse=2, name="db-outage")
    return spec


def _start(client: TestClient) -> int:
    r = client.post("/v1/studies", json=_spec())
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _job_id(client: TestClient, sid: int) -> str:
    """The running runner's job (the POST's submit may have failed on a loaded head, and
    the reconciler submitted it)."""
    job_id = _get(client, f"/v1/studies/{sid}")["ray_job_id"]
    assert job_id, "a running study without a job id"
    return str(job_id)


def test_a_cut_shorter_than_the_window_is_waited_out(
    proxy: CuttableProxy, pg_db_url: str, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """Cut for 30 s (the issue's reproduction: 32 s) with a 90 s window: the runner waits,
    its workers train on, and the study completes in the same runner job; no trial is run
    a second time. Before: the runner gave up after ~24 s of retries, and its FAILED write
    went through once the database was back: the study FAILED for good."""
    with _api(proxy, ray_head, tmp_path, outage_s=90) as client:
        sid = _start(client)
        seen = _until(
            "a trial done, another running",
            lambda: _mid_study(client, sid),
            show=lambda: _trials(client, sid),
        )
        before = snapshot(seen["done"])
        job_id = _job_id(client, sid)
        proxy.cut_for(CUT_S).join()
        study = _until("study end", lambda: _finished(client, sid), timeout=300)
    assert study["status"] == "COMPLETED", study["error"]
    assert job_attempts(pg_db_url, sid) == 1  # one runner did it all
    trials = check_finished_study(pg_db_url, sid)
    assert {t.state for t in trials} == {"COMPLETE"}
    assert all(t.attempts == 1 for t in trials), [(t.number, t.attempts) for t in trials]
    assert_untouched(before, trials)
    logs = JobLauncher(ray_head.dashboard_url).logs(job_id)
    assert "database unreachable" in logs  # the cut did reach the runner, which waited


def test_a_cut_longer_than_the_window_leaves_the_study_running_for_a_relaunch(
    proxy: CuttableProxy, pg_db_url: str, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """Cut for 15 s with a 3 s window: the runner exits non-zero (Ray shows the job FAILED),
    the study is never FAILED, and once the database is back the reconciler relaunches it;
    the new runner resumes the open trials and completes the study. Before: FAILED, as
    above (the runner's give-up is the same path)."""
    launcher = JobLauncher(ray_head.dashboard_url)
    with _api(proxy, ray_head, tmp_path, outage_s=3) as client:
        sid = _start(client)
        seen = _until(
            "a trial done, another running",
            lambda: _mid_study(client, sid),
            show=lambda: _trials(client, sid),
        )
        before = snapshot(seen["done"])
        job_id = _job_id(client, sid)
        proxy.cut_for(LONG_CUT_S)
        _until("the runner's exit", lambda: launcher.status(job_id) == "FAILED", timeout=60)
        assert proxy.is_cut  # it exited while the database was away, and by itself
        study = _until(
            "study end",
            lambda: _finished(client, sid),
            timeout=300,
            show=lambda: (_trials(client, sid), _jobs(launcher, sid)),
        )
    assert study["status"] == "COMPLETED", study["error"]
    assert study["error"] is None  # never FAILED on the way (a terminal status is never left)
    # a relaunch (more than one where a loaded head lost a submission's answer: test_faults)
    assert job_attempts(pg_db_url, sid) >= 2
    assert "database unreachable, left RUNNING" in launcher.logs(job_id)
    # The exit (75, as Ray's job list shows it) was weather: charged to its own bound, never
    # to max_job_attempts (issue 42 item 2: before, each such exit was a dead runner).
    exited = next(j for j in launcher.list_jobs() if j.submission_id == job_id)
    assert exited.driver_exit_code == EXIT_DATABASE_AWAY
    failures, weather = job_charges(pg_db_url, sid)
    assert weather >= 1 and failures == 0, (failures, weather)
    trials = check_finished_study(pg_db_url, sid)
    assert {t.state for t in trials} == {"COMPLETE"}
    assert_untouched(before, trials)


def _finished(client: TestClient, sid: int) -> dict[str, Any] | None:
    study: dict[str, Any] = _get(client, f"/v1/studies/{sid}")
    return study if study["status"] in ("COMPLETED", "FAILED", "CANCELLED") else None


def _jobs(launcher: JobLauncher, sid: int) -> list[tuple[str, str, str]]:
    """The study's runner jobs: id, status, the end of the log (what a timeout shows)."""
    mine = [j for j in launcher.list_jobs() if (j.metadata or {}).get("qkscope_study") == str(sid)]
    return [(j.submission_id, str(j.status), launcher.logs(j.submission_id)[-3000:]) for j in mine]
