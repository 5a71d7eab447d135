"""Fixtures shared by the service tests: one app per database module with an API token, in
process or served by uvicorn (the Ray heads are in tests/conftest.py)."""

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
from service.control.ray_cluster import LocalRayHead
from service.store.session import make_engine
from tests.conftest import free_port

TOKEN = "service-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


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
