"""Fixtures that create real databases (SQLite files, throwaway PostgreSQL databases)
and real Ray clusters, and clean them up."""

from __future__ import annotations

import os
import secrets
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Ray fixes its auth mode once per process (C++ config, read at first use), so every Ray
# cluster these tests start or join runs with token auth and one session token, set here
# before any test module imports Ray.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

# A service started by a test keeps no standby runner (service/control/standby.py) unless the
# test asks for one (tests/service/test_standby.py): on two cores a standby warming worker
# processes beside every end-to-end study only slows the suite and adds no coverage.
os.environ.setdefault("QKSCOPE_STANDBY", "0")
# Test modules pile up PENDING studies (no Ray) in one app; the live cap's own tests set it.
os.environ.setdefault("QKSCOPE_MAX_LIVE_STUDIES", "100000")

PG_ADMIN_URL = os.environ.get("QKSCOPE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
SHARED = Path(__file__).resolve().parents[2] / "shared"
WIKITEXT = SHARED / "data" / "wikitext-2"
ROOT = Path(__file__).resolve().parents[1]


# Tests that run real Ray studies: a Ray head on two loaded cores now and then starts a job
# or a task late enough to pass a test's deadline (seen: a study still PENDING after 240 s
# in one full run out of three, passing alone every time). Such a test is run once more
# before it fails the run; a second failure is a failure. Nothing else is rerun.
_RAY_MODULES = {
    "test_faults.py",
    "test_fence_lag.py",
    "test_node_loss.py",
    "test_gpu_check.py",
    "test_inbox_backpressure.py",
    "test_slot_worker.py",
    "test_cli.py",  # `qkscope serve` subprocesses start Ray heads of their own
    "test_serve_guard.py",
}
# QKSCOPE_TEST_RERUNS=0 while debugging a Ray test: see its failure at once.
_RERUNS = int(os.environ.get("QKSCOPE_TEST_RERUNS", "1"))
_RAY_FIXTURES = {"ray_head", "shared_ray_head", "own_ray_head", "local_ray", "cluster"}


def uses_ray(item: pytest.Item) -> bool:
    return (
        item.get_closest_marker("cluster") is not None
        or bool(_RAY_FIXTURES & set(getattr(item, "fixturenames", ())))
        or item.path.name in _RAY_MODULES
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Rerun a Ray test once (above), and group the tests for an optional pytest-xdist run
    (`pytest -n 4 --dist loadgroup` on a machine with cores to spare): every test that
    touches Ray in one group, run by one worker in turn on the session's one shared head,
    the rest module by module (each module's fixtures built once). The default run is
    serial: on two cores, unit tests beside the Ray tests slowed those past their deadlines
    (CI: 25 reruns, 65 min)."""
    for item in items:
        if uses_ray(item):
            if _RERUNS:
                item.add_marker(pytest.mark.flaky(reruns=_RERUNS, reruns_delay=5))
            item.add_marker(pytest.mark.xdist_group("ray"))
        else:
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(ROOT).as_posix()))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Keep Python's fault handler on past pytest's own (which it turns off here), so that a
    crash while the interpreter shuts down (C extensions' threads: Ray's, torch's) prints
    every thread's stack instead of a bare "Segmentation fault" after a passing run."""
    import faulthandler
    import sys

    faulthandler.enable(file=sys.__stderr__, all_threads=True)


def _pg_available() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3):
            return None
    except Exception as e:  # noqa: BLE001 - any failure means "no server"
        return str(e)


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The PostgreSQL admin URL; a missing server skips locally and fails under CI=true."""
    problem = _pg_available()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL required under CI=true but unreachable: {problem}")
        pytest.skip(f"PostgreSQL unreachable: {problem}")
    return PG_ADMIN_URL


def _create_pg_db(admin_url: str) -> tuple[str, str]:
    import psycopg

    name = f"qkscope_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0]
    return name, f"{base}/{name}"


def _drop_pg_db(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _throwaway_pg_db(admin_url: str) -> Iterator[str]:
    name, url = _create_pg_db(admin_url)
    try:
        yield url
    finally:
        _drop_pg_db(admin_url, name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind (no schema yet)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'qkscope.db'}"
        return
    with _throwaway_pg_db(request.getfixturevalue("pg_server")) as url:
        yield url


@pytest.fixture
def pg_db_url(pg_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database (for tests about PostgreSQL behaviour only)."""
    with _throwaway_pg_db(pg_server) as url:
        yield url


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_db_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """Like `db_url`, shared by the tests of one module (one app per database)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'qkscope.db'}"
        return
    with _throwaway_pg_db(request.getfixturevalue("pg_server")) as url:
        yield url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
