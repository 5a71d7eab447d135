"""Restarts on a real Ray head with its job server (token auth): the runner's Ray job killed
mid-study and then the whole Ray cluster coming back empty (one study), and the API process
stopped and started mid-study. Each study must finish with every planned trial accounted
for, completed trials untouched, and their metric rows intact and unduplicated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.control.reconciler import reconcile
from service.store import Store, migrate
from service.store.models import Study, StudyStatus
from service.store.session import make_engine, make_sessionmaker
from tests.conftest import free_port
from tests.service.helpers import (
    Get,
    assert_untouched,
    finished,
    job_attempts,
    kill_runner,
    progress,
    settings_for,
    snapshot,
    wait_until,
)
from tests.service.invariants import INTERRUPT_STEPS, check_finished_study, fault_spec

pytestmark = pytest.mark.cluster


@pytest.fixture
def app(
    db_url: str, own_ray_head: LocalRayHead, tmp_path: Path
) -> Iterator[tuple[TestClient, Get]]:
    """The API in-process with its reconciler loop running every second, on a Ray head of
    the test's own (the test stops it)."""
    with TestClient(create_app(settings_for(db_url, own_ray_head, tmp_path))) as client:

        def get(path: str) -> Any:
            r = client.get(path)
            assert r.status_code == 200, r.text
            return r.json()

        yield client, get


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_killed_runner_then_a_restarted_cluster_are_each_resumed(
    app: tuple[TestClient, Get], db_url: str, own_ray_head: LocalRayHead
) -> None:
    """The suite's runner kill and cluster loss, one after the other in one study. First the
    runner job is SIGKILLed mid-study (Ray shows the job FAILED): the reconciler resubmits
    it. Then, once the new runner has trained on, the whole cluster goes away at once and
    comes back empty (same address, same token; Ray no longer knows the job): the reconciler
    resubmits again. Each new runner resumes the interrupted trials from their checkpoints
    and runs no completed trial again. (A fused variant inside the API-restart test could
    not catch its study mid-flight: fused members finish together.)"""
    client, get = app
    # seven trials two at a time: still running after the first resume, with trials left
    r = client.post("/v1/studies", json=fault_spec(n_trials=7, steps=INTERRUPT_STEPS))
    assert r.status_code == 201, r.text
    sid, job_id = r.json()["id"], r.json()["ray_job_id"]
    seen = wait_until("progress", lambda: progress(get, sid))
    kill_runner(own_ray_head, job_id)

    def resumed() -> dict[str, Any] | None:
        """Progress made by a runner other than the killed one."""
        if get(f"/v1/studies/{sid}")["ray_job_id"] in (None, job_id):
            return None
        now = progress(get, sid)
        return now if now and len(now["done"]) > len(seen["done"]) else None

    again = wait_until("progress after the resubmission", resumed)
    second_job = get(f"/v1/studies/{sid}")["ray_job_id"]
    # Gone at once (a graceful `ray stop` took ~20 s here, long enough for the study to end)
    own_ray_head.stop(grace_s=0)
    assert get(f"/v1/studies/{sid}")["status"] == "RUNNING"  # the premise: it was cut off
    own_ray_head.start()
    launcher = JobLauncher(own_ray_head.dashboard_url)
    assert launcher.status(second_job) is None, "the new cluster is empty"

    study = wait_until("study end", lambda: finished(get, sid), timeout=400)
    assert study["status"] == "COMPLETED", study["error"]
    assert job_attempts(db_url, sid) >= 3
    assert study["ray_job_id"] not in (job_id, second_job)
    trials = check_finished_study(db_url, sid)
    assert_untouched(snapshot(again["done"]), trials)  # what was done before either fault
    interrupted = {t["number"] for t in seen["running"] + again["running"]}
    assert all(t.attempts >= 2 for t in trials if t.number in interrupted)


def reconcile_rounds(http: httpx.Client) -> float:
    """Rounds the API process's reconciler has completed (Prometheus counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "qkscope_reconcile_rounds_total":
                return float(sample.value)
    raise AssertionError("no qkscope_reconcile_rounds_total in /metrics")


class ApiProcess:
    """`uvicorn service.app:create_app --factory` in a child process, configured by env."""

    def __init__(self, env: dict[str, str], port: int) -> None:
        self.env, self.port = env, port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=self.env)
        wait_until("API up", self._healthy, timeout=60)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        # A graceful stop within 30 s; uvicorn re-raises the signal after shutting down.
        assert self.proc.wait(timeout=30) in (0, -signal.SIGTERM)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_api_process_restart_mid_study(db_url: str, ray_head: LocalRayHead, tmp_path: Path) -> None:
    """Restarting the API process changes nothing for a live study (a fused one, `fuse:
    2`): the new process's reconciler sees the live job and leaves it alone, and the same
    runner job completes the study."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QKSCOPE_")}
    env |= {
        "QKSCOPE_DATABASE_URL": db_url,
        "QKSCOPE_RAY_ADDRESS": ray_head.dashboard_url,
        "QKSCOPE_HOME": str(tmp_path),
        "QKSCOPE_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "QKSCOPE_RECONCILE_INTERVAL_S": "1",
        "QKSCOPE_API_TOKENS": "restart-test-token",
        "QKSCOPE_STANDBY": "0",  # as every service a test starts (tests/conftest.py)
    }
    api = ApiProcess(env, port)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": "Bearer restart-test-token"},
        timeout=30,
    )

    def get(path: str) -> Any:
        r = http.get(path)
        assert r.status_code == 200, r.text
        return r.json()

    api.start()
    try:
        # Long enough that it is still running after the first restart.
        spec = {**fault_spec(n_trials=6, steps=INTERRUPT_STEPS), "fuse": 2}
        r = http.post("/v1/studies", json=spec)
        assert r.status_code == 201, r.text
        sid, job_id = r.json()["id"], r.json()["ray_job_id"]
        wait_until("a trial running", lambda: progress(get, sid) or finished(get, sid))

        # 1. Stop and start the API while the runner works: the same job carries on.
        api.stop()
        api.start()
        # The new API process's reconciler demonstrably looked at the study three times
        # (its round counter, scraped from /metrics) and left the live job alone.
        wait_until("three reconcile rounds", lambda: reconcile_rounds(http) >= 3, timeout=120)
        assert job_attempts(db_url, sid) == 1
        assert JobLauncher(ray_head.dashboard_url).status(job_id) in ("RUNNING", "SUCCEEDED")

        # 2. The same runner job finishes the study.
        study = wait_until("study end", lambda: finished(get, sid), timeout=400)
        assert study["status"] == "COMPLETED", study["error"]
        assert job_attempts(db_url, sid) == 1 and study["ray_job_id"] == job_id
        trials = check_finished_study(db_url, sid)
        assert {t.state for t in trials} == {"COMPLETE"}
        assert all(t.attempts == 1 for t in trials)
    finally:
        http.close()
        if api.proc is not None and api.proc.poll() is None:
            api.proc.kill()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_reconciler_gives_up_after_max_job_attempts(
    db_url: str, ray_head: LocalRayHead, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A study whose runner job keeps dying is FAILED with the reason, not resubmitted
    forever (its job id is one Ray does not know: the cluster lost it); and an unreachable
    job server makes no study look dead."""
    migrate.upgrade(db_url)
    settings = settings_for(db_url, ray_head, tmp_path, max_job_attempts=3)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with sessions.begin() as s:
        doomed = Study(
            name="doomed", status=StudyStatus.RUNNING, spec=fault_spec(1), n_trials=1,
            optuna_study_name="x", ray_job_id="qkscope-study-0-a3-gone", job_attempts=3,
            job_failures=2,  # two runners died before: the third death is the last allowed
        )  # fmt: skip
        s.add(doomed)
    assert reconcile(Store(sessions), JobLauncher(ray_head.dashboard_url), settings, grace_s=0) == 0
    with sessions() as s:
        row = s.get(Study, doomed.id)
        assert row is not None and row.status == StudyStatus.FAILED
        assert row.error and "died 3 times" in row.error and "gone" in row.error

    # When Ray's job server can't answer, no job is judged dead and nothing is resubmitted.
    with sessions.begin() as s:
        live = Study(
            name="live", status=StudyStatus.RUNNING, spec=fault_spec(1), n_trials=1,
            optuna_study_name="y", ray_job_id="qkscope-study-0-a1-unknown", job_attempts=1,
        )  # fmt: skip
        s.add(live)
    unreachable = JobLauncher(ray_head.dashboard_url)
    unreachable._client._address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert reconcile(Store(sessions), unreachable, settings, grace_s=0) == 0
    assert "job list is unavailable" in caplog.text  # judged nothing, submitted nothing
    with sessions() as s:
        row = s.get(Study, live.id)
        assert row is not None
        assert (row.status, row.job_attempts) == (StudyStatus.RUNNING, 1)
    engine.dispose()
