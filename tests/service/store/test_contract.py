"""The row store's written contract (service/store/__init__.py), clause by clause, on real
SQLite and real PostgreSQL: one test suite for every database, as Optuna runs its storage
tests on every storage."""

from __future__ import annotations

import threading
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState as OptunaState
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from service.control.cancel import cancel_study
from service.runner.search import Search
from service.spec import StudySpec
from service.store import Charge, Store
from service.store.models import Metric, Study, StudyStatus, Trial, TrialState
from service.store.optuna import optuna_storage, optuna_study_name, stored_outcome
from service.store.session import (
    ReadOnlyError,
    make_reader,
    session_scope,
)
from service.store.trials import ResultRow
from tests.service.helpers import small_quickstart


def _study(store: Store) -> int:
    row, created = store.studies.create(StudySpec.model_validate(small_quickstart()))
    assert created
    return row.id


def _trial(s: sessionmaker[Session], row_id: int) -> Trial:
    with session_scope(s) as session:
        row = session.get(Trial, row_id)
        assert row is not None
        session.expunge(row)
        return row


def _result(loss: float = 1.5) -> ResultRow:
    summary = {"status": "completed", "steps_done": 40, "final_val_loss": loss}
    return ResultRow(TrialState.COMPLETE, summary, "node", [loss], True, 40, 10.0, 12.5, 2.5)


# ---- one writer -----------------------------------------------------------------------------


def test_read_sessions_refuse_every_write(store: Store, engine: Engine) -> None:
    sid = _study(store)
    reader = make_reader(engine)
    with session_scope(reader) as s:
        assert s.get(Study, sid) is not None  # reads work
    with pytest.raises(ReadOnlyError), session_scope(reader) as s:
        s.execute(update(Study).where(Study.id == sid).values(name="x"))
    with pytest.raises(ReadOnlyError), session_scope(reader) as s:
        row = s.get(Study, sid)
        assert row is not None
        row.name = "changed"  # flushed at commit
    with pytest.raises(ReadOnlyError), session_scope(reader) as s:
        s.add(Trial(study_id=sid, number=99, params={}))
    with pytest.raises(ReadOnlyError), session_scope(reader) as s:
        s.execute(text("DELETE FROM qk_trial"))
    with session_scope(reader) as s:  # what a reader may run besides SELECT: settings
        if s.get_bind().dialect.name == "postgresql":
            s.execute(text("SET LOCAL extra_float_digits = 1"))
    assert store.studies.get(sid).name == "quickstart"  # type: ignore[union-attr]


# ---- ends are conditional -----------------------------------------------------------------


def test_a_terminal_study_status_is_never_left(store: Store) -> None:
    sid = _study(store)
    assert store.studies.set_status(sid, StudyStatus.RUNNING)
    started = store.studies.get(sid).started_at  # type: ignore[union-attr]
    assert started is not None
    row, job = store.studies.cancel(sid)
    assert row is not None and row.status == StudyStatus.CANCELLED
    assert not store.studies.set_status(sid, StudyStatus.COMPLETED)
    assert not store.studies.fail_live(sid, "late")
    row = store.studies.get(sid)
    assert row is not None and row.status == StudyStatus.CANCELLED and row.error is None
    assert store.studies.cancel(sid)[1] is None  # a second cancel stops no job


def test_a_trial_ends_once_whoever_comes_first(store: Store) -> None:
    sid = _study(store)
    a = store.trials.insert_queued(sid, 0, {"seed": 1}, 1)
    b = store.trials.insert_queued(sid, 1, {}, 0)
    assert store.trials.finish_open(sid, TrialState.CANCELLED, "study cancelled", None) == 2
    assert not store.trials.record_result(a, _result())
    assert not store.trials.record_failure(b, "late", 1.0)
    ra, rb = _trial(store.sessions, a), _trial(store.sessions, b)
    assert ra.state == rb.state == TrialState.CANCELLED
    assert ra.summary is None and ra.final_val_loss is None and rb.error == "study cancelled"
    c = store.trials.insert_queued(sid, 2, {}, 0)
    assert store.trials.record_result(c, _result(1.25))
    assert store.trials.finish_open(sid, TrialState.CANCELLED, "study cancelled", None) == 0
    rc = _trial(store.sessions, c)
    assert rc.state == TrialState.COMPLETE and rc.value == 1.25 and rc.final_val_loss == 1.25
    assert rc.duration_s == pytest.approx(2.5)  # the worker's own clock


@pytest.mark.parametrize("rounds", [12])
def test_a_cancel_racing_a_result_leaves_one_consistent_ending(store: Store, rounds: int) -> None:
    """Two threads, two connections, one row: the result and the cancel race; each round ends
    either COMPLETE with its summary or CANCELLED without one, never a mix, and exactly one
    of the two writers reports that it ended the row."""
    sid = _study(store)
    for n in range(rounds):
        row_id = store.trials.insert_queued(sid, n, {}, 0)
        won: dict[str, Any] = {}
        go = threading.Barrier(2)

        def result(
            row_id: int = row_id, won: dict[str, Any] = won, go: threading.Barrier = go
        ) -> None:
            go.wait()
            won["result"] = store.trials.record_result(row_id, _result())

        def cancel(won: dict[str, Any] = won, go: threading.Barrier = go) -> None:
            go.wait()
            won["cancel"] = store.trials.finish_open(sid, TrialState.CANCELLED, "c", None) > 0

        threads = [threading.Thread(target=result), threading.Thread(target=cancel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        row = _trial(store.sessions, row_id)
        assert won["result"] != won["cancel"], won
        if won["result"]:
            assert row.state == TrialState.COMPLETE and row.summary is not None
        else:
            assert row.state == TrialState.CANCELLED and row.summary is None


def test_a_cancel_after_a_recorded_result_tells_optuna_what_was_recorded(
    store: Store, db_url: str
) -> None:
    """The other side of the race: the runner recorded a result, then the API's cancel ran
    before the runner told Optuna (and the job was stopped, so it never will). Before: the
    cancel failed every RUNNING Optuna trial, so our table said COMPLETE and Optuna FAIL."""
    sid = _study(store)
    spec = StudySpec.model_validate(small_quickstart())
    storage = optuna_storage(db_url)
    try:
        study = optuna.create_study(
            storage=storage, study_name=optuna_study_name(sid), directions=spec.directions()
        )
        done, left = study.ask(), study.ask()
        done_id = store.trials.insert_queued(sid, done.number, {}, 0)
        left_id = store.trials.insert_queued(sid, left.number, {}, 0)
        assert store.trials.record_result(done_id, _result(1.25))  # the runner's record...
        cancel_study(store, None, sid, db_url)  # ...then the cancel, before the runner's tell
        told = stored_outcome(spec, TrialState.COMPLETE, _result(1.25).summary, [1.25])
        Search(spec, sid, storage).tell(done, told)  # a late tell changes nothing
        trials = {t.number: t for t in study.get_trials()}
        assert trials[done.number].state == OptunaState.COMPLETE
        assert trials[done.number].values == [1.25]
        assert trials[done.number].user_attrs["qkscope_status"] == "completed"
        # the constraint values reach Optuna as the runner would have told them
        constraints = [v for k, v in trials[done.number].system_attrs.items() if "constraint" in k]
        assert len(constraints) == len(spec.constraints) > 0
        assert trials[left.number].state == OptunaState.FAIL
        assert _trial(store.sessions, done_id).state == TrialState.COMPLETE
        assert _trial(store.sessions, left_id).state == TrialState.CANCELLED
    finally:
        storage.engine.dispose()


# ---- replays are no-ops -------------------------------------------------------------------


def test_replayed_reports_and_inserts_change_nothing(store: Store) -> None:
    sid = _study(store)
    row_id = store.trials.insert_queued(sid, 0, {}, 0)
    assert store.trials.insert_queued(sid, 0, {}, 0) == row_id  # a retried insert
    batch = [(row_id, 40, "val_loss", None, None, 2.0), (row_id, 40, "rank_ratio", 1, None, 0.5)]
    store.trials.store_reports(batch)
    store.trials.store_reports(batch)  # replayed from the journal
    store.trials.store_reports([(row_id, 20, "val_loss", None, None, 2.5)])  # an older one
    with session_scope(store.sessions) as s:
        rows = s.scalar(select(func.count()).where(Metric.trial_id == row_id))
    assert rows == 3
    assert _trial(store.sessions, row_id).last_step == 40
    with session_scope(store.sessions) as s:
        points = s.execute(
            select(Metric.step, Metric.layer, Metric.head, Metric.value)
            .where(Metric.trial_id == row_id, Metric.name == "val_loss")
            .order_by(Metric.step)
        ).all()
    assert [tuple(p) for p in points] == [(20, -1, -1, 2.5), (40, -1, -1, 2.0)]


def test_starts_move_queued_to_running_and_count_retries(store: Store) -> None:
    from service.store.trials import StartRow

    sid = _study(store)
    row_id = store.trials.insert_queued(sid, 0, {}, 0)
    store.trials.record_starts({row_id: StartRow("node-a", 1, 100.0)})
    store.trials.record_starts({row_id: StartRow("node-b", 2, None)})
    row = _trial(store.sessions, row_id)
    assert row.state == TrialState.RUNNING and row.node == "node-b" and row.attempts == 2
    assert row.started_at is not None and row.started_at.timestamp() == pytest.approx(100.0)


def test_writing_the_same_starts_again_counts_nothing(store: Store) -> None:
    """Issue 27 (10b): a start batch retried after a commit whose acknowledgement was lost
    counted its retries twice; attempts are now written as a count, and never go down."""
    from service.store.trials import StartRow

    sid = _study(store)
    row_id = store.trials.insert_queued(sid, 0, {}, 0)
    for _ in range(2):  # the write, then its retry
        store.trials.record_starts({row_id: StartRow("node-a", 3, 100.0)})
    assert _trial(store.sessions, row_id).attempts == 3
    store.trials.record_starts({row_id: StartRow("node-b", 2, None)})  # an older, late batch
    row = _trial(store.sessions, row_id)
    assert row.attempts == 3 and row.node == "node-b"


# ---- launches are claimed -------------------------------------------------------------------


def _ids(study_id: int, attempt: int) -> str:
    return f"job-{study_id}-a{attempt}"


def _launch_state(store: Store, sid: int) -> tuple[int, str | None, int, int]:
    row = store.studies.get(sid)
    assert row is not None
    return row.job_attempts, row.ray_job_id, row.job_failures, row.weather_relaunches


def test_a_launch_is_claimed_against_what_the_caller_saw(store: Store) -> None:
    """The claim and its job id are one write; attempt numbers never go down (issue 42
    item 1: `unclaim_launch` decremented them, so the next launch reused attempt n and the
    fence admitted two runners)."""
    sid = _study(store)
    assert store.studies.claim_launch(sid, 0, _ids) == (1, f"job-{sid}-a1")
    assert _launch_state(store, sid) == (1, f"job-{sid}-a1", 0, 0)
    assert store.studies.claim_launch(sid, 0, _ids) is None  # somebody launched it
    assert not hasattr(store.studies, "unclaim_launch")  # no way to hand attempt 1 out again
    # Ray answered that it never took the job: the id goes, the attempt stays spent.
    assert not store.studies.forget_unsubmitted(sid, 1, "another-job")
    assert store.studies.forget_unsubmitted(sid, 1, f"job-{sid}-a1")
    assert _launch_state(store, sid) == (1, None, 0, 0)
    assert store.studies.claim_launch(sid, 1, _ids) == (2, f"job-{sid}-a2")  # never 1 again
    assert not store.studies.forget_unsubmitted(sid, 1, f"job-{sid}-a1")  # a stale attempt
    store.studies.cancel(sid)
    assert store.studies.claim_launch(sid, None, _ids) is None  # ended: no launch
    assert _launch_state(store, sid) == (2, f"job-{sid}-a2", 0, 0)


def test_a_relaunch_charges_the_dead_job_in_its_claim(store: Store) -> None:
    sid = _study(store)
    store.studies.claim_launch(sid, 0, _ids)
    assert store.studies.claim_launch(sid, 1, _ids, Charge.FAILURE) == (2, f"job-{sid}-a2")
    assert store.studies.claim_launch(sid, 2, _ids, Charge.WEATHER) == (3, f"job-{sid}-a3")
    assert store.studies.claim_launch(sid, 3, _ids, Charge.WEATHER) == (4, f"job-{sid}-a4")
    assert store.studies.claim_launch(sid, 3, _ids, Charge.FAILURE) is None  # stale: no charge
    assert _launch_state(store, sid) == (4, f"job-{sid}-a4", 1, 2)


def test_a_claim_whose_job_id_is_not_recorded_is_not_claimed(store: Store) -> None:
    """Claim and job record are one transaction: before, `claim_launch` committed and a
    failing `record_job` left an attempt spent with no job (job_attempts 1 -> 5 in a
    read-only failover with no runner started)."""
    sid = _study(store)

    def broken(study_id: int, attempt: int) -> str:
        raise RuntimeError("the record fails after the claim")

    with pytest.raises(RuntimeError, match="record fails"):
        store.studies.claim_launch(sid, 0, broken)
    assert _launch_state(store, sid) == (0, None, 0, 0)
    assert store.studies.claim_launch(sid, 0, _ids) == (1, f"job-{sid}-a1")


def test_an_idempotency_key_gives_one_study(store: Store) -> None:
    spec = StudySpec.model_validate(small_quickstart())
    first, created = store.studies.create(spec, "key-1")
    again, created_again = store.studies.create(spec, "key-1")
    assert created and not created_again and again.id == first.id


def test_a_dead_runners_trial_is_claimed_once_per_runner_attempt(store: Store) -> None:
    """Issue 27: the claim is retried after a dropped connection; a retry whose first try
    had committed (the acknowledgement lost) counted the attempt twice."""
    from service.store.trials import StartRow

    sid = _study(store)
    row_id = store.trials.insert_queued(sid, 0, {}, 0)
    queued = store.trials.insert_queued(sid, 1, {}, 0)
    store.trials.record_starts({row_id: StartRow("node-a", 1, 100.0)})
    assert store.trials.claim_orphan(sid, 0, runner=2).attempts == 2  # type: ignore[union-attr]
    assert store.trials.claim_orphan(sid, 0, runner=2).attempts == 2  # type: ignore[union-attr]
    assert store.trials.claim_orphan(sid, 0, runner=3).attempts == 3  # type: ignore[union-attr]
    assert store.trials.claim_orphan(sid, 1, runner=3).attempts == 1  # type: ignore[union-attr]
    assert store.trials.claim_orphan(sid, 7, runner=3) is None  # no row: asked, never written
    assert _trial(store.sessions, queued).state == TrialState.QUEUED
