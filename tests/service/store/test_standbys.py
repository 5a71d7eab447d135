"""Standby rows (service/store/standbys.py) on real SQLite and PostgreSQL: a reserved id is
claimed by at most one POST, only while its runner's heartbeat is fresh, and a claimed row is
an ordinary study that no standby operation touches again."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import update

from service.control.ray_cluster import job_id_for
from service.spec import StudySpec
from service.store import STANDBY, Store, Waiting, utcnow
from service.store.models import Study, StudyStatus
from service.store.session import session_scope
from tests.service.helpers import small_quickstart


def _spec(name: str = "claimer") -> StudySpec:
    return StudySpec.model_validate(small_quickstart() | {"name": name})


def _row(store: Store, study_id: int) -> Study:
    row = store.studies.get(study_id)
    assert row is not None
    return row


def _ready(store: Store) -> int:
    """A standby whose runner has said it is warm."""
    sid, _ = store.standbys.add(job_id_for)
    assert store.standbys.look(sid, heartbeat=True) is Waiting.WAITING
    return sid


def test_a_standby_reserves_an_id_with_its_first_attempt_and_job_id(store: Store) -> None:
    sid, job = store.standbys.add(job_id_for)
    row = _row(store, sid)
    assert row.status == STANDBY and row.job_attempts == 1 and row.ray_job_id == job
    assert job.startswith(f"qkscope-study-{sid}-a1-")  # what a cold launch of `sid` submits
    assert row.started_at is None  # no heartbeat yet: not claimable
    assert store.studies.live() == [] and store.studies.ended_with_open_trials() == []


def test_a_post_claims_a_ready_standby_and_keeps_its_job(store: Store) -> None:
    sid = _ready(store)
    before = _row(store, sid)
    row, created = store.studies.create(_spec())
    assert created and row.id == sid
    after = _row(store, sid)
    assert after.status == StudyStatus.PENDING and after.name == "claimer"
    assert after.ray_job_id == before.ray_job_id and after.job_attempts == 1
    assert after.spec["name"] == "claimer" and after.n_trials == _spec().budget.n_trials
    assert after.started_at is None  # the heartbeat is gone: started_at is the study's again
    assert after.created_at >= before.created_at
    assert store.standbys.look(sid, heartbeat=True) is Waiting.CLAIMED
    assert _row(store, sid).started_at is None  # a claimed row takes no heartbeat
    # the standby is used up: the next POST inserts a row of its own
    other, created = store.studies.create(_spec("second"))
    assert created and other.id != sid and other.job_attempts == 0 and other.ray_job_id is None


def test_a_standby_without_a_fresh_heartbeat_is_not_claimed(store: Store) -> None:
    silent, _ = store.standbys.add(job_id_for)  # never said it is warm
    stale = _ready(store)
    with session_scope(store.sessions) as s:
        old = utcnow() - timedelta(minutes=5)
        s.execute(update(Study).where(Study.id == stale).values(started_at=old))
    row, created = store.studies.create(_spec())
    assert created and row.id not in (silent, stale)
    assert _row(store, silent).status == STANDBY and _row(store, stale).status == STANDBY


def test_the_oldest_ready_standby_is_claimed_first(store: Store) -> None:
    first, second = _ready(store), _ready(store)
    assert store.studies.create(_spec("a"))[0].id == first
    assert store.studies.create(_spec("b"))[0].id == second
    assert store.standbys.listed() == []


def test_look_and_drop(store: Store) -> None:
    sid = _ready(store)
    assert [r[0] for r in store.standbys.listed()] == [sid]
    assert store.standbys.drop(sid)
    assert store.standbys.look(sid, heartbeat=True) is Waiting.GONE
    assert store.studies.get(sid) is None and store.standbys.listed() == []
    claimed = _ready(store)
    store.studies.create(_spec())
    assert not store.standbys.drop(claimed)  # a claimed row is a study: it stays
    assert _row(store, claimed).status == StudyStatus.PENDING


def test_an_idempotent_retry_returns_the_claimed_study(store: Store) -> None:
    sid = _ready(store)
    spare = _ready(store)
    row, created = store.studies.create(_spec(), idempotency_key="k-1")
    again, created_again = store.studies.create(_spec(), idempotency_key="k-1")
    assert created and not created_again and row.id == again.id == sid
    assert _row(store, spare).status == STANDBY  # the retry consumed nothing


def test_concurrent_posts_claim_one_standby_once(store: Store) -> None:
    sid = _ready(store)
    barrier = threading.Barrier(4)
    ids: list[int] = []
    errors: list[BaseException] = []

    def post(i: int) -> None:
        try:
            barrier.wait()
            row, created = store.studies.create(_spec(f"racer-{i}"))
            assert created
            ids.append(row.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(ids) == 4 and len(set(ids)) == 4 and ids.count(sid) == 1
    assert _row(store, sid).status == StudyStatus.PENDING
