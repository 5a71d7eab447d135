"""Fixtures that create real databases (SQLite files, throwaway PostgreSQL databases)
and real Ray clusters, and clean them up."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from service.control.ray_cluster import LocalRayHead

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
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER:
    # two workers on two cores: a unit test's tiny matmuls gain nothing from a second
    # thread and spin-wait against the Ray studies beside them
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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
    """Rerun a Ray test once (above), and group the tests for an opt-in pytest-xdist run
    (`-n 2 --dist loadgroup --no-loadscope-reorder`; serial is the default, see
    docs/development.md): every test that touches Ray in one group, run by one worker
    in turn on the session's one shared head, and placed first so that the longest chain
    starts at once; the rest module by module (each module's fixtures built once), taken
    by the other worker, and by this one once the Ray group is done."""
    for item in items:
        if uses_ray(item):
            if _RERUNS:
                item.add_marker(pytest.mark.flaky(reruns=_RERUNS, reruns_delay=5))
            item.add_marker(pytest.mark.xdist_group("ray"))
        else:
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(ROOT).as_posix()))
    if _XDIST_WORKER:
        items.sort(key=lambda item: not uses_ray(item))  # stable: module order kept


def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """On the xdist controller: refuse to run if the groups did not reach the scheduler.
    pytest 9.2 ignores the node-id suffix `--dist loadgroup` relies on (pytest-xdist#1386);
    Ray tests then run on both workers at once, on one shared head, past their deadlines."""
    if ids and not any("@" in i for i in ids):
        raise pytest.UsageError(
            "--dist loadgroup did not group the tests (no '@group' in the node ids): this "
            "pytest and pytest-xdist disagree on node ids (pytest-xdist#1386); pin pytest<9.2"
        )


def _renice(value: int) -> None:
    """Every thread of this process to `value` (Linux: a thread's nice value is its own)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        # raising a priority needs root: without it the unit tests simply are not niced
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, value)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, the worker running a unit test yields the CPU to the one running Ray
    studies (whose deadlines are real time): nice 10. At 19 (below Ray's own workers, 15)
    a browser test starved past its 15 s wait in one run; with Ray's workers at 0 the Ray
    group took longer in the one run that tried it."""
    if _XDIST_WORKER:
        _renice(0 if uses_ray(item) else 10)


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


# ---- Ray heads ---------------------------------------------------------------------------


def _start_head(home: Path) -> LocalRayHead:
    from service.control.ray_cluster import LocalRayHead

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
    from service.control.ray_cluster import JobLauncher

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
