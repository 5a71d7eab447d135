"""Helpers shared by the service tests: small study definitions, waiting for a study or a
condition, the settings of an API on the shared Ray head, killing a runner, snapshots of
finished trials, the `qkscope` CLI as a subprocess, and the bad-input checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.store.models import Study
from service.store.session import make_engine, make_sessionmaker
from tests.conftest import ROOT
from tests.service.invariants import INTERRUPT_STEPS


def small_quickstart(n_trials: int = 4, steps: int = 40) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    spec["budget"]["n_trials"] = n_trials
    spec["base"]["steps"] = steps
    spec["base"]["eval_every"] = 20
    return dict(spec)


def wait_for(
    client: TestClient, study_id: int, statuses: set[str], timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        study = client.get(f"/v1/studies/{study_id}").json()
        if study["status"] in statuses:
            return dict(study)
        time.sleep(0.5)
    raise AssertionError(f"study {study_id} not in {statuses} after {timeout}s: {study}")


Get = Callable[[str], Any]


def settings_for(db_url: str, head: LocalRayHead, home: Path, **kw: Any) -> Settings:
    return Settings(
        database_url=db_url,
        ray_address=head.dashboard_url,
        home=home,
        checkpoint_dir=str(home / "ckpt"),
        reconcile_interval_s=1.0,
        **kw,
    )


def wait_until(what: str, cond: Callable[[], Any], timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := cond():
            return out
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def progress(get: Get, sid: int) -> dict[str, Any] | None:
    """Once a trial is COMPLETE and another RUNNING with a checkpoint: the study's trials.

    `running` holds only trials between step 40 (a checkpoint exists) and half of
    INTERRUPT_STEPS: a trial at its last step may still show RUNNING while the runner
    finishes it (a fused group's mates are finished one after another), and one killed
    then would already be COMPLETE, never retried.
    """
    trials = get(f"/v1/studies/{sid}/trials?limit=100")["items"]
    done = [t for t in trials if t["state"] == "COMPLETE"]
    running = [
        t
        for t in trials
        if t["state"] == "RUNNING" and 40 <= t["last_step"] <= INTERRUPT_STEPS // 2
    ]
    return {"done": done, "running": running} if done and running else None


def finished(get: Get, sid: int) -> dict[str, Any] | None:
    study: dict[str, Any] = get(f"/v1/studies/{sid}")
    return study if study["status"] in ("COMPLETED", "FAILED", "CANCELLED") else None


def kill_runner(head: LocalRayHead, job_id: str) -> None:
    """SIGKILL the study's runner process (the Ray job's driver), as a crash would."""
    client = JobLauncher(head.dashboard_url)._client
    info = wait_until("driver pid", lambda: client.get_job_info(job_id).driver_info, timeout=60)
    os.kill(int(info.pid), signal.SIGKILL)
    wait_until("job death", lambda: client.get_job_status(job_id).value == "FAILED", timeout=60)


def snapshot(trials: list[dict[str, Any]]) -> dict[int, tuple[Any, ...]]:
    return {t["number"]: (t["finished_at"], t["final_val_loss"], t["attempts"]) for t in trials}


def assert_untouched(before: dict[int, tuple[Any, ...]], trials: list[Any]) -> None:
    """Trials that had completed before the fault were not run again or rewritten."""
    after = {
        t.number: (iso(t.finished_at), t.final_val_loss, t.attempts)
        for t in trials
        if t.number in before
    }
    want = {n: (iso(datetime.fromisoformat(f)), v, a) for n, (f, v, a) in before.items()}
    assert after == want


def iso(d: datetime) -> str:
    return d.replace(tzinfo=None).isoformat(timespec="seconds")


def job_attempts(db_url: str, sid: int) -> int:
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            return int(s.scalar(select(Study.job_attempts).where(Study.id == sid)) or 0)
    finally:
        engine.dispose()


def job_charges(db_url: str, sid: int) -> tuple[int, int]:
    """The study's (job_failures, weather_relaunches): its runners' deaths as charged."""
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            row = s.get(Study, sid)
            assert row is not None
            return row.job_failures, row.weather_relaunches
    finally:
        engine.dispose()


def cli_env(home: Path, api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QKSCOPE_", "RAY_"))}
    env["QKSCOPE_HOME"] = str(home)
    env["QKSCOPE_API_URL"] = api_url
    env["PYTHONPATH"] = str(ROOT)
    return env


def qkscope(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def ray_left(gcs_port: int) -> bool:
    return subprocess.run(["pgrep", "-f", f"gcs_server_port={gcs_port}"]).returncode == 0


def worker_pid(dashboard: str, name: str) -> int | None:
    from ray.util.state import list_tasks

    tasks = list_tasks(
        address=dashboard,
        filters=[("name", "=", name), ("state", "=", "RUNNING")],
        detail=True,
        timeout=30,
    )
    pids = [t.worker_pid for t in tasks if t.worker_pid]
    return int(pids[0]) if pids else None


def wild_and_calm(n_trials: int, steps: int) -> dict[str, Any]:
    """Plain SGD without clipping: lr 10 diverges (tests/workers/test_trial), lr 0.1 does
    not. The grid sampler runs every (lr, seed) pair, so some members are wild, some calm."""
    return {
        "name": "fused-divergence",
        "base": {
            "task": {
                "kind": "associative_recall",
                "seq_len": 16,
                "n_pairs": 4,
                "n_symbols": 8,
                "n_valid": 32,
            },
            "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
            "optim": {"name": "sgd", "schedule": "constant", "lr": 0.1, "grad_clip": None},
            "batch_size": 8,
            "steps": steps,
            "eval_every": 10,
            "eval_batches": 2,
            "probe_batch_size": 4,
            "device": "cpu",
            "dtype": "float32",
            "checkpoint": {"every_evals": 1},
        },
        "search_space": {
            "optim.lr": {"type": "categorical", "choices": [0.1, 10.0]},
            "seed": {"type": "categorical", "choices": [1, 2, 3]},
        },
        "sampler": {"kind": "grid", "seed": 0},
        "budget": {"n_trials": n_trials},
        "parallelism": 1,
        "fuse": 4,
        "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
        "resources": {"cpus": 1, "gpus": 0},
    }


# ---- bad input: a POST that must be refused, naming the field, writing nothing ----------

VALID: dict[str, Any] = {
    "name": "ok",
    "budget": {"n_trials": 4},
    "search_space": {
        "optim.lr": {"type": "float", "low": 0.0001, "high": 0.01, "log": True},
        "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
    },
    "constraints": [{"metric": "min_norm_entropy", "op": ">=", "value": 0.1}],
}


def n_studies(engine: Engine) -> int:
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(Study)) or 0)


def _subsequence(want: list[str], have: list[str]) -> bool:
    it = iter(have)
    return all(any(w == h for h in it) for w in want)


def names_field(body: dict[str, Any], field: str) -> bool:
    """The error names `field`: exactly, or with pydantic's union tags in between, or, for the
    spec's cross-field checks that are reported against 'body', in the message."""
    want = field.split(".")
    if any(_subsequence(want, e["field"].split(".")) for e in body["errors"]):
        return True
    return any(e["field"] == "body" for e in body["errors"]) and field in body["message"]


def post(c: TestClient, body: Any, ctype: str) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post("/v1/studies", content=content, headers={"content-type": ctype})


def check_rejected(c: TestClient, body: Any, ctype: str, label: str = "") -> dict[str, Any]:
    r = post(c, body, ctype)
    assert 400 <= r.status_code < 500, (label, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), label
    out = r.json()
    assert set(out) == {"error", "message", "errors"}, (label, out)
    assert isinstance(out["errors"], list) and isinstance(out["message"], str)
    assert all(isinstance(e["field"], str) and e["field"] for e in out["errors"]), out
    if r.status_code in (400, 422):
        assert out["errors"], (label, out)
    out["status"] = r.status_code
    return dict(out)


class StandInJob:
    """One job of `StandInRay`: what Ray's job list gives the reconciler."""

    def __init__(self, submission_id: str, study_id: int, attempt: int) -> None:
        from ray.job_submission import JobStatus

        self.submission_id, self.study_id, self.attempt = submission_id, study_id, attempt
        self.status = JobStatus.RUNNING
        self.driver_exit_code: int | None = None
        self.end_time: int | None = None  # ms, as Ray's

    def end(self, exit_code: int, ago_s: float = 0.0) -> None:
        """The runner exits with `exit_code`, `ago_s` seconds ago."""
        from ray.job_submission import JobStatus

        self.status = JobStatus.SUCCEEDED if exit_code == 0 else JobStatus.FAILED
        self.driver_exit_code = exit_code
        self.end_time = int((time.time() - ago_s) * 1000)


class StandInRay:
    """An in-process stand-in for Ray's job server at the one boundary the launch path
    talks to (`JobLauncher`: submit, lookup, list, stop), so the launch, the store and the
    reconciler run for real without a cluster. `submit` picks how a submission goes:
    "ok"; "reset" (Ray takes the job, then the connection is reset before the answer);
    "refused" (the connection never opens: Ray never sees the job). `lookup_down` makes
    asking for one job fail (Ray does not answer)."""

    address = "http://stand-in-ray:8265"

    def __init__(self) -> None:
        self.jobs: dict[str, StandInJob] = {}
        self.submit = "ok"
        self.lookup_down = False

    def submit_study(
        self, study_id: int, attempt: int, env: dict[str, str], job_id: str | None = None
    ) -> str:
        import requests

        assert job_id is not None
        if self.submit == "refused":
            raise requests.exceptions.ConnectionError("[Errno 111] Connection refused")
        assert job_id not in self.jobs, f"{job_id} submitted twice"
        self.jobs[job_id] = StandInJob(job_id, study_id, attempt)
        if self.submit == "reset":
            raise requests.exceptions.ConnectionError(
                "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"
            )
        return job_id

    def lookup(self, job_id: str) -> str | None:
        import requests

        if self.lookup_down:
            raise requests.exceptions.ConnectionError("[Errno 111] Connection refused")
        job = self.jobs.get(job_id)
        return None if job is None else str(job.status.value)

    def list_jobs(self) -> list[StandInJob]:
        return list(self.jobs.values())

    def stop(self, job_id: str) -> bool:
        if (job := self.jobs.get(job_id)) is not None and job.end_time is None:
            job.end(-15)
            return True
        return False

    def attempts(self, study_id: int) -> list[int]:
        """The attempts of every job ever submitted for the study, in submission order."""
        return [j.attempt for j in self.jobs.values() if j.study_id == study_id]

    def running(self, study_id: int) -> list[StandInJob]:
        return [j for j in self.jobs.values() if j.study_id == study_id and j.end_time is None]
