"""A read-only failover is weather (issue 42 item 3), on a real PostgreSQL made read-only the
way a demoted primary or a standby is (`default_transaction_read_only` on a throwaway
database: every write fails with SQLSTATE 25006).

Before: 25006 was not "away": runners died at once (a study bug) and were charged; POST
answered 500; `claim_launch` committed while `record_job` failed (attempts 1 -> 5 with no
runner); `give_up` raised out of the round; pooled read-only connections survived
`pool_pre_ping` and kept failing after the database was writable again."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from service.app import create_app
from service.config import Settings
from service.control.ray_cluster import job_id_for
from service.control.reconciler import reconcile
from service.spec import StudySpec
from service.store import DatabaseUnavailable, Fence, Store, StudyStatus, migrate
from service.store.optuna import optuna_storage
from service.store.session import (
    database_away,
    make_engine,
    make_sessionmaker,
    outage_window,
)
from tests.service.conftest import AUTH, TOKEN
from tests.service.helpers import StandInRay, small_quickstart


def read_only(url: str, on: bool) -> None:
    """Make the database read-only for every session opened from now on (a failover to a
    server that refuses writes), or writable again. Turning it on also ends the sessions
    open now (a failover does): pooled connections reconnect, through their pre-ping, to
    the read-only database."""
    plain = url.replace("postgresql+psycopg://", "postgresql://")
    name = plain.rsplit("/", 1)[1]
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("SET default_transaction_read_only = off")  # this session writes
        conn.execute(
            f'ALTER DATABASE "{name}" SET default_transaction_read_only = {"on" if on else "off"}'
        )
        if on:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )


@pytest.fixture
def pg(pg_db_url: str) -> Iterator[tuple[str, Engine, Store]]:
    migrate.upgrade(pg_db_url)
    engine = make_engine(pg_db_url)
    yield pg_db_url, engine, Store(make_sessionmaker(engine))
    engine.dispose()
    read_only(pg_db_url, False)


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _study(store: Store) -> int:
    row, _ = store.studies.create(StudySpec.model_validate(small_quickstart()))
    return row.id


def test_a_read_only_servers_connection_is_discarded_not_pooled(
    pg: tuple[str, Engine, Store],
) -> None:
    url, engine, store = pg
    sid = _study(store)
    read_only(url, True)
    engine.dispose()  # the pool now opens connections to the "new", read-only server
    before = _backend_pid(engine)  # pooled, and answers its pre-ping
    with pytest.raises(DBAPIError) as err:
        store.studies.claim_launch(sid, 0, job_id_for)
    assert database_away(err.value) and "25006" in str(getattr(err.value.orig, "sqlstate", ""))
    assert err.value.connection_invalidated  # discarded: not returned to the pool
    read_only(url, False)
    assert _backend_pid(engine) != before  # a fresh connection, writable
    claimed = store.studies.claim_launch(sid, 0, job_id_for)
    assert claimed is not None and claimed[0] == 1  # the failed claim spent nothing


def test_a_runner_write_waits_out_a_read_only_window(pg: tuple[str, Engine, Store]) -> None:
    """A runner's write meets 25006: it is retried like a dropped connection, and succeeds
    once the database takes writes again; a window that stays read-only ends in
    `DatabaseUnavailable` (the runner exits 75, the study left RUNNING), never a failure."""
    url, engine, store = pg
    sid = _study(store)
    claimed = store.studies.claim_launch(sid, 0, job_id_for)
    assert claimed is not None
    runner = Store(store.sessions, Fence(sid, claimed[0]))
    read_only(url, True)
    with outage_window(1.0), pytest.raises(DatabaseUnavailable):
        runner.studies.set_status(sid, StudyStatus.RUNNING)
    timer = threading.Timer(1.5, read_only, (url, False))
    timer.start()
    try:
        with outage_window(30.0):
            assert runner.studies.set_status(sid, StudyStatus.RUNNING)
    finally:
        timer.join()
    assert store.studies.status(sid) == StudyStatus.RUNNING


def test_post_answers_503_and_writes_nothing_while_read_only(
    pg: tuple[str, Engine, Store], tmp_path: Path
) -> None:
    url, engine, _ = pg
    settings = Settings(database_url=url, api_tokens=TOKEN, home=tmp_path)
    with TestClient(
        create_app(settings, reconcile_loop=False), raise_server_exceptions=False, headers=AUTH
    ) as c:
        assert c.get("/v1/studies").status_code == 200
        read_only(url, True)
        r = c.post("/v1/studies", json=small_quickstart())
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"].isdigit()
        assert r.json()["error"] == "database_unavailable"
        read_only(url, False)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM qk_study")).scalar_one() == 0
        r = c.post("/v1/studies", json=small_quickstart())
        assert r.status_code == 201, r.text  # its read-only connections were not kept


def test_every_reconcile_step_survives_a_read_only_database(
    pg: tuple[str, Engine, Store], tmp_path: Path
) -> None:
    """A round during the failover writes nothing and raises nothing: the study to give up
    on and the study to launch are both judged again once writes work."""
    url, engine, store = pg
    settings = Settings(
        database_url=url, ray_address=StandInRay.address, home=tmp_path, max_job_attempts=1
    )
    ray = StandInRay()
    doomed, waiting = _study(store), _study(store)
    claimed = store.studies.claim_launch(doomed, 0, job_id_for)
    assert claimed is not None
    ray.jobs[claimed[1]] = job = _job(claimed[1], doomed)
    job.end(1)  # its one allowed runner died: the round gives up on it
    read_only(url, True)
    with outage_window(0.5):
        assert reconcile(store, cast(Any, ray), settings, grace_s=0) == 0
    assert ray.attempts(waiting) == []
    read_only(url, False)
    for sid, status, attempts in ((doomed, StudyStatus.PENDING, 1), (waiting, "PENDING", 0)):
        row = store.studies.get(sid)
        assert row is not None and (row.status, row.job_attempts) == (status, attempts)
    assert reconcile(store, cast(Any, ray), settings, grace_s=0) == 1
    gone, launched = store.studies.get(doomed), store.studies.get(waiting)
    assert gone is not None and gone.status == StudyStatus.FAILED
    assert launched is not None and launched.job_attempts == 1 and ray.attempts(waiting) == [1]


def _job(job_id: str, sid: int) -> Any:
    from tests.service.helpers import StandInJob

    return StandInJob(job_id, sid, 1)


def test_optunas_storage_discards_read_only_connections_too(
    pg: tuple[str, Engine, Store],
) -> None:
    """The runner's Optuna calls go through Optuna's own engine: a 25006 there is weather
    as well (found through Optuna's StorageInternalError), and its connection is not kept."""
    import optuna

    url, _, _ = pg
    storage = optuna_storage(url)
    try:
        optuna.create_study(storage=storage, study_name="before")  # a pooled connection
        read_only(url, True)
        optuna.load_study(storage=storage, study_name="before")  # reads work: pooled again
        with pytest.raises(Exception) as err:
            optuna.create_study(storage=storage, study_name="during")
        assert database_away(err.value)
        read_only(url, False)
        optuna.create_study(storage=storage, study_name="after")  # a fresh, writable one
    finally:
        storage.engine.dispose()
