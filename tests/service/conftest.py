"""Fixtures shared by the service tests: a real local Ray head (token auth, job server), and
one app per database module with an API token, in process or served by uvicorn."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from service.app import create_app
from service.config import Settings, get_settings
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.store.session import make_engine
from tests.conftest import free_port

TOKEN = "service-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _start_head(home: Path) -> LocalRayHead:
    head = LocalRayHead(home, gcs_port=free_port(), dashboard_port=free_port(), num_cpus=2)
    head.start()
    return head


@pytest.fixture(scope="session")
def shared_ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    """One real local Ray head (token auth, job server) for every test of the session that
    does not stop, restart or kill it: starting a head costs 5-15 s on two cores."""
    head = _start_head(tmp_path_factory.mktemp("rayhome"))
    try:
        yield head
    finally:
        head.stop()


def stop_live_jobs(head: LocalRayHead, timeout_s: float = 60.0) -> None:
    """Stop every job on the head that has not ended and wait until Ray says so: a study a
    test left running must not take the next test's CPUs."""
    launcher = JobLauncher(head.dashboard_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = [j.submission_id for j in launcher.list_jobs() if not j.status.is_terminal()]
        if not live:
            return
        for job_id in live:
            launcher.stop(job_id)
        time.sleep(0.5)
    raise AssertionError(f"jobs still live on the shared Ray head after {timeout_s}s: {live}")


@pytest.fixture
def ray_head(shared_ray_head: LocalRayHead) -> Iterator[LocalRayHead]:
    """The session's shared Ray head; after the test, every job it left live is stopped. A
    test that stops or kills its head takes `own_ray_head` instead."""
    yield shared_ray_head
    assert shared_ray_head.alive(), "a test stopped the shared Ray head (use own_ray_head)"
    stop_live_jobs(shared_ray_head)


@pytest.fixture
def own_ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    """A Ray head of the test's own, for a test that stops, restarts or kills it."""
    head = _start_head(tmp_path_factory.mktemp("rayhome"))
    try:
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="module")
def app_settings(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("home")
    return Settings(database_url=module_db_url, ray_address="", api_tokens=TOKEN, home=home)


@pytest.fixture(scope="module")
def client(app_settings: Settings) -> Iterator[TestClient]:
    """The app in process (no Ray: studies stay PENDING), sending the token."""
    app = create_app(app_settings, reconcile_loop=False)
    with TestClient(app, raise_server_exceptions=False, headers=AUTH) as c:
        yield c


@pytest.fixture(scope="module")
def engine(client: TestClient, module_db_url: str) -> Iterator[Engine]:
    eng = make_engine(module_db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def app_client(db_url: str, ray_head: LocalRayHead, tmp_path: Path) -> Iterator[TestClient]:
    """The app in process on a fresh database of each kind, submitting to the module's Ray
    head (no token: the end-to-end tests' own settings)."""
    settings = Settings(
        database_url=db_url,
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    with TestClient(create_app(settings, reconcile_loop=False)) as client:
        yield client


def create_via_api(client: TestClient, body: dict[str, Any]) -> int:
    r = client.post("/v1/studies", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


@contextlib.contextmanager
def live_api(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The app served by uvicorn on a free loopback port; the CLI pointed at it."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, reconcile_loop=False),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("QKSCOPE_API_URL", url)
    monkeypatch.setenv("QKSCOPE_API_TOKEN", TOKEN)
    get_settings.cache_clear()
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        get_settings.cache_clear()
