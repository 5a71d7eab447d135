"""A database outage is weather, not a verdict (issue 32): retries bounded by a window, not a
count; the API's 503 with Retry-After; background loops that live through an outage; and the
two races of the same issue around Optuna's tells (items 4 and 5). Real SQLite files, real
PostgreSQL behind a TCP proxy that cuts it off (tests/service/db_proxy.py), Optuna's real
storage. The studies cut off mid-run on a real Ray head: test_db_outage_study.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient
from optuna.storages import RDBStorage
from optuna.trial import TrialState as OptunaState
from prometheus_client import CollectorRegistry
from sqlalchemy import select, text, update

from service.app import create_app
from service.config import Settings
from service.control.db_health import DatabaseHealth, watch_database
from service.control.reconciler import LauncherSlot, close_leftovers, reconcile_forever
from service.read import prom
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.models import Study, StudyStatus, Trial, TrialState
from service.store.optuna import Outcome, optuna_storage, optuna_study_name, tell_outcome
from service.store.session import (
    DatabaseUnavailable,
    database_away,
    make_engine,
    make_sessionmaker,
    normalize_url,
    ping,
    with_retry,
)
from tests.service.conftest import AUTH, TOKEN
from tests.service.db_proxy import CuttableProxy
from tests.service.invariants import fault_spec


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield Store(make_sessionmaker(engine))
    engine.dispose()


@pytest.fixture
def proxy(pg_db_url: str) -> Iterator[CuttableProxy]:
    migrate.upgrade(pg_db_url)
    p = CuttableProxy(pg_db_url)
    yield p
    p.close()


# ---- with_retry: what "away" is, and how long it is waited for --------------------------------


def test_an_unreachable_sqlite_file_is_waited_for_until_it_is_back(tmp_path: Path) -> None:
    """A real SQLite database on a directory that is not there yet (a lost mount): "unable
    to open database file" is the database being away; the unit succeeds once it is back."""
    where = tmp_path / "mount"
    engine = make_engine(f"sqlite:///{where / 'q.db'}")
    sessions = make_sessionmaker(engine)
    threading.Timer(1.5, lambda: where.mkdir()).start()
    t0 = time.monotonic()
    try:
        with_retry(lambda: ping(sessions), "ping", outage_s=30, base_s=0.05, max_s=0.2)
    finally:
        engine.dispose()
    assert 1.4 < time.monotonic() - t0 < 10


def test_past_the_window_the_outage_is_database_unavailable(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'nowhere' / 'q.db'}")
    sessions = make_sessionmaker(engine)
    calls = []

    def unit() -> None:
        calls.append(1)
        ping(sessions)

    t0 = time.monotonic()
    try:
        with pytest.raises(DatabaseUnavailable) as caught:
            with_retry(unit, "ping", outage_s=1.0, base_s=0.05, max_s=0.2)
    finally:
        engine.dispose()
    assert 0.8 < time.monotonic() - t0 < 5 and len(calls) > 3
    assert database_away(caught.value)


def test_a_bug_is_not_an_outage(tmp_path: Path) -> None:
    """SQLite's "no such table" is an OperationalError too, but no wait mends it: it is
    retried only for the short transient budget and raised as it is, never as an outage."""
    engine = make_engine(f"sqlite:///{tmp_path / 'q.db'}")
    sessions = make_sessionmaker(engine)

    def unit() -> None:
        with sessions() as s:
            s.execute(text("SELECT * FROM no_such_table"))

    t0 = time.monotonic()
    try:
        with pytest.raises(Exception, match="no such table") as caught:
            with_retry(unit, "read", outage_s=600, transient_s=0.5, base_s=0.05, max_s=0.1)
    finally:
        engine.dispose()
    assert time.monotonic() - t0 < 5
    assert not database_away(caught.value)


def test_a_cut_postgresql_is_away_and_waited_for(proxy: CuttableProxy) -> None:
    """Real PostgreSQL behind the proxy: cut for 3 s while a unit of work runs; the unit
    is repeated until the database answers (the old 8 attempts are not the limit: time is)."""
    engine = make_engine(proxy.url)
    sessions = make_sessionmaker(engine)
    try:
        ping(sessions)  # a pooled connection that the cut will break
        proxy.cut_for(3.0)
        try:
            ping(sessions)
        except Exception as e:
            assert database_away(e), repr(e)
        else:
            raise AssertionError("the cut did not reach the pooled connection")
        t0 = time.monotonic()
        with_retry(lambda: ping(sessions), "ping", outage_s=60, base_s=0.1, max_s=0.5)
        assert time.monotonic() - t0 > 1.5
    finally:
        engine.dispose()


# ---- the API: 503 with Retry-After, /healthz, the background loops -------------------------


def test_the_api_answers_503_with_retry_after_while_the_database_is_away(
    proxy: CuttableProxy, tmp_path: Path
) -> None:
    """Before: every route that reads answered 500 (an unhandled OperationalError)."""
    settings = Settings(database_url=proxy.url, api_tokens=TOKEN, home=tmp_path)
    with TestClient(
        create_app(settings, reconcile_loop=False), raise_server_exceptions=False, headers=AUTH
    ) as c:
        assert c.get("/v1/studies").status_code == 200
        wait_for_health(c, "up")
        proxy.cut()
        for path in ("/v1/studies", "/v1/studies/1", "/v1/studies/1/trials"):
            r = c.get(path)
            assert r.status_code == 503, (path, r.status_code, r.text)
            assert r.headers["retry-after"].isdigit()
            assert r.json()["error"] == "database_unavailable"
        r = c.post("/v1/studies/1/cancel")
        assert r.status_code == 503, r.text
        health = c.get("/healthz")  # alive, at once, and it says what is down
        assert health.status_code == 200
        assert health.json()["database"] == "down" and health.json()["status"] == "degraded"
        proxy.restore()
        wait_for_health(c, "up", timeout=30)
        assert c.get("/v1/studies").status_code == 200


def wait_for_health(c: TestClient, state: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while c.get("/healthz").json()["database"] != state:
        assert time.monotonic() < deadline, c.get("/healthz").json()
        time.sleep(0.2)


def test_a_non_outage_database_error_is_still_a_500(tmp_path: Path) -> None:
    """The 503 is for a database that is away only: a broken table is a bug, a 500."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    settings = Settings(database_url=url, api_tokens=TOKEN, home=tmp_path)
    with TestClient(
        create_app(settings, reconcile_loop=False), raise_server_exceptions=False, headers=AUTH
    ) as c:
        engine = make_engine(url)
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE qk_study RENAME TO qk_study_gone"))
        engine.dispose()
        assert c.get("/v1/studies").status_code == 500


def test_the_reconciler_and_the_probe_live_through_an_outage(
    proxy: CuttableProxy, pg_db_url: str
) -> None:
    """Every round that meets the database away is logged and the next one runs: after the
    outage the reconciler still does its work (here: says on a PENDING study that Ray does
    not answer) and the probe sees the database back."""
    direct = make_engine(pg_db_url)
    store = Store(make_sessionmaker(direct))
    settings = Settings(
        database_url=proxy.url, ray_address="http://127.0.0.1:9", reconcile_interval_s=0.2
    )
    engine = make_engine(proxy.url)
    proxied = Store(make_sessionmaker(engine))
    rounds = prom.reconcile_counter(CollectorRegistry())
    health = DatabaseHealth()

    async def scenario() -> dict[str, Any]:
        loops = [
            asyncio.create_task(
                reconcile_forever(proxied, LauncherSlot("http://127.0.0.1:9"), settings, rounds)
            ),
            asyncio.create_task(
                watch_database(health, lambda: ping(proxied.sessions), interval_s=0.2)
            ),
        ]
        proxy.cut()

        async def until(cond: Any, what: str) -> None:
            deadline = time.monotonic() + 30
            while not cond():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.1)

        # rounds that meet the database away (the first one also waits for Ray's client)
        await until(lambda: health.up is False and rounds._value.get() >= 2, "rounds in a cut")
        down = (health.up, rounds._value.get())
        row, _ = await asyncio.to_thread(
            store.studies.create, StudySpec.model_validate(fault_spec(n_trials=1))
        )
        await until(lambda: rounds._value.get() >= down[1] + 2, "more rounds in the cut")
        assert all(not t.done() for t in loops), [t for t in loops if t.done()]
        during = rounds._value.get()
        proxy.restore()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = await asyncio.to_thread(store.studies.get, row.id)
            if got is not None and got.waiting_reason and health.up:
                break
            await asyncio.sleep(0.2)
        for t in loops:
            t.cancel()
        return {"down": down, "during": during, "after": rounds._value.get(), "row": got}

    try:
        out = asyncio.run(scenario())
    finally:
        engine.dispose()
        direct.dispose()
    assert out["down"][0] is False
    assert out["after"] > out["during"] >= 1  # rounds went on during and after the cut
    assert out["row"].waiting_reason.startswith("Ray cluster unreachable")
    assert health.up is True


# ---- item 4: a cancel that lands between tell_outcome's check and its writes -----------------


def _constrained_spec() -> StudySpec:
    spec = fault_spec(n_trials=2)
    spec["constraints"] = [{"metric": "min_norm_entropy", "op": ">=", "value": 0.1}]
    return StudySpec.model_validate(spec)


class _CancelAfterCheck(RDBStorage):
    """Optuna's real RDB storage whose next `get_trial` (tell_outcome's check) is followed,
    before it returns, by another writer finishing the trial: what a cancel does (FAIL with
    `qkscope_status`) through its own storage and connection."""

    def __init__(self, url: str, other: RDBStorage) -> None:
        super().__init__(url)
        self.other = other
        self.armed = False

    def get_trial(self, trial_id: int) -> Any:
        trial = super().get_trial(trial_id)
        if self.armed:
            self.armed = False
            self.other.set_trial_user_attr(trial_id, "qkscope_status", "cancelled")
            self.other.set_trial_state_values(trial_id, OptunaState.FAIL)
        return trial


def test_a_cancel_between_the_check_and_the_writes_wins_quietly(db_url: str) -> None:
    """Before: the cancel finished the trial after tell_outcome saw it RUNNING; its
    set_constraint raised UpdateFinishedTrialError (the runner crashed, a cancel answered
    500, a reconcile round aborted). Now the later writer finds it told and changes nothing."""
    spec = _constrained_spec()
    other = optuna_storage(db_url)
    racing = _CancelAfterCheck(normalize_url(db_url), other)
    try:
        study = optuna.create_study(storage=racing, study_name=optuna_study_name(1))
        trial = study.ask()
        outcome = Outcome("completed", TrialState.COMPLETE, [1.5], [-0.5])
        racing.armed = True
        tell_outcome(study, trial._trial_id, spec, outcome)
        assert not racing.armed  # the cancel did land between the check and the writes
        told = other.get_trial(trial._trial_id)
        assert told.state == OptunaState.FAIL  # the first writer's outcome, untouched
        assert told.user_attrs["qkscope_status"] == "cancelled"
        assert told.values is None
        # and with nothing in between, a tell still tells
        second = study.ask()
        tell_outcome(study, second._trial_id, spec, outcome)
        assert other.get_trial(second._trial_id).state == OptunaState.COMPLETE
        assert other.get_trial(second._trial_id).values == [1.5]
    finally:
        racing.engine.dispose()
        other.engine.dispose()


# ---- item 5: close_leftovers guarded, its Optuna step found again --------------------------


def _leftover(store: Store, db_url: str, status: StudyStatus) -> int:
    """A study that ended `status` with two trials open, ours and Optuna's."""
    row, _ = store.studies.create(StudySpec.model_validate(fault_spec(n_trials=2, steps=20)))
    storage = optuna_storage(db_url)
    try:
        study = optuna.create_study(storage=storage, study_name=optuna_study_name(row.id))
        for n in range(2):
            study.ask()
            store.trials.insert_queued(row.id, n, {}, 0)
    finally:
        storage.engine.dispose()
    store.studies.set_status(row.id, StudyStatus.RUNNING)
    if status == StudyStatus.FAILED:
        store.studies.fail_live(row.id, "a bug")
    else:
        store.studies.cancel(row.id)
    return row.id


def _running_optuna(db_url: str, sid: int) -> int:
    storage = optuna_storage(db_url)
    try:
        study = optuna.load_study(study_name=optuna_study_name(sid), storage=storage)
        return len(study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,)))
    finally:
        storage.engine.dispose()


def _set_spec(store: Store, sid: int, spec: Any) -> None:
    with store.sessions() as s, s.begin():  # a test's raw write: a spec the store cannot read
        s.execute(update(Study).where(Study.id == sid).values(spec=spec))


def test_a_close_whose_optuna_step_failed_is_finished_next_round(
    db_url: str, store: Store, tmp_path: Path
) -> None:
    """Before: finish_open closed our rows, then its Optuna step failed (here: a spec it
    cannot read); the next rounds looked for open rows of ours only, so those Optuna trials
    stayed RUNNING for good, and the exception skipped the rest of the round (the other
    study's close, and every launch). Now the failure is logged, the other study is closed,
    and the next round finds the Optuna trials by themselves and closes them."""
    settings = Settings(database_url=db_url, home=tmp_path)
    broken = _leftover(store, db_url, StudyStatus.FAILED)
    fine = _leftover(store, db_url, StudyStatus.CANCELLED)
    with store.sessions() as s:
        good_spec = s.scalar(select(Study.spec).where(Study.id == broken))
    _set_spec(store, broken, {"not": "a spec"})
    close_leftovers(store, settings)  # must not raise
    with store.sessions() as s:
        states = dict(
            s.execute(select(Trial.study_id, Trial.state).where(Trial.study_id == broken)).all()
        )
    assert set(states.values()) == {TrialState.FAILED}  # our rows closed before the failure
    assert _running_optuna(db_url, broken) == 2  # ... Optuna's not
    assert _running_optuna(db_url, fine) == 0  # the other study was still closed
    assert store.studies.ended_with_open_trials() == [(broken, "FAILED", "a bug")]
    _set_spec(store, broken, good_spec)
    close_leftovers(store, settings)
    assert _running_optuna(db_url, broken) == 0
    assert store.studies.ended_with_open_trials() == []
