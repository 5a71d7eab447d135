"""No secret in any Ray job: a database URL with a password never appears in Ray's jobs API
(runtime_env, metadata, entrypoint), yet the study's runner finds the database and finishes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.control.launch import runner_env
from service.control.ray_cluster import JobLauncher, LocalRayHead
from tests.service.helpers import small_quickstart, wait_for

PASSWORD = "pw-9f3c1e77-not-for-jobs"


def with_password(url: str) -> str:
    """`postgresql://postgres@host/db` with a password (trust auth ignores it)."""
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{PASSWORD}@{host}"


def test_runner_env_carries_a_0600_file_not_the_url(tmp_path: Path) -> None:
    url = f"postgresql://u:{PASSWORD}@db:5432/x"
    env = runner_env(Settings(database_url=url, home=tmp_path))
    assert PASSWORD not in json.dumps(env)
    path = Path(env["QKSCOPE_DATABASE_URL_FILE"])
    assert path.read_text() == url
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # Operator-provided file: passed through as is; "node": nothing at all.
    own = tmp_path / "url"
    own.write_text(url + "\n")
    env = runner_env(Settings(database_url_file=str(own), home=tmp_path))
    assert env["QKSCOPE_DATABASE_URL_FILE"] == str(own)
    assert Settings(database_url_file=str(own)).resolved_database_url() == url
    env = runner_env(Settings(database_url=url, home=tmp_path, runner_db_source="node"))
    assert set(env) == {"QKSCOPE_CHECKPOINT_DIR", "QKSCOPE_DB_OUTAGE_S"}


def test_runner_env_is_safe_from_many_threads_at_once(tmp_path: Path) -> None:
    """POSTs now submit from threads in parallel (issue 32): each writes the URL file; they
    all wrote one temporary name (the pid's), and the loser's rename failed its submit."""
    from concurrent.futures import ThreadPoolExecutor

    settings = Settings(database_url="postgresql://u@db:5432/x", home=tmp_path)
    with ThreadPoolExecutor(16) as pool:
        envs = list(pool.map(lambda _: runner_env(settings), range(400)))
    path = Path(envs[0]["QKSCOPE_DATABASE_URL_FILE"])
    assert all(e["QKSCOPE_DATABASE_URL_FILE"] == str(path) for e in envs)
    assert path.read_text() == "postgresql://u@db:5432/x"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


@pytest.mark.cluster
def test_password_never_reaches_the_jobs_api(
    pg_db_url: str, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    url = with_password(pg_db_url)
    settings = Settings(
        database_url=url,
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    assert "QKSCOPE_DATABASE_URL" not in os.environ  # the node's environment has no URL
    with TestClient(create_app(settings, reconcile_loop=False)) as client:
        r = client.post("/v1/studies", json=small_quickstart(n_trials=1, steps=20))
        assert r.status_code == 201, r.text
        sid, job_id = r.json()["id"], r.json()["ray_job_id"]
        final = wait_for(client, sid, {"COMPLETED", "FAILED"}, timeout=300)
        assert final["status"] == "COMPLETED", final["error"]  # the runner found the database
    jobs_client = JobLauncher(ray_head.dashboard_url)._client
    info = jobs_client.get_job_info(job_id)
    seen = [repr(info), json.dumps(info.runtime_env), str(info.metadata), info.entrypoint]
    seen += [repr(j) for j in jobs_client.list_jobs()]
    assert "QKSCOPE_DATABASE_URL_FILE" in json.dumps(info.runtime_env)
    for text in seen:
        assert PASSWORD not in text
