"""The faults a review found in the runner, cancel and launch (issue 27), each provoked through
real processes: real SQLite and PostgreSQL, a real Ray head and job server, Optuna's real
storage. Each of these failed before the fix it names."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import ray
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from service.config import Settings
from service.control.cancel import cancel_study
from service.control.launch import launch_study
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.control.reconciler import reconcile
from service.runner.configs import slot_key
from service.runner.pool import RayPool
from service.runner.records import Status, TrialRecord
from service.runner.scheduler import Scheduler
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.models import StudyStatus, Trial, TrialState
from service.store.optuna import optuna_storage, optuna_study_name
from service.store.session import make_engine, make_sessionmaker
from tests.service.helpers import wait_for
from tests.service.invariants import INTERRUPT_STEPS, check_finished_study, fault_spec
from tests.workers.helpers import TINY
from workers.config import TrialSummary
from workers.inbox import InboxReporter, TrialInbox
from workers.messages import Assignment, HandedBack, WorkerDone
from workers.slot_worker import SlotWorker

pytestmark = pytest.mark.cluster


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    yield Store(make_sessionmaker(engine))
    engine.dispose()


def _open_rows(store: Store, sid: int) -> list[tuple[int, str]]:
    with store.sessions() as s:
        rows = s.execute(
            select(Trial.number, Trial.state).where(
                Trial.study_id == sid, Trial.state.in_(("QUEUED", "RUNNING"))
            )
        ).all()
    return [(n, st) for n, st in rows]


def _running_optuna(db_url: str, sid: int) -> list[int]:
    storage = optuna_storage(db_url)
    try:
        study = optuna.load_study(study_name=optuna_study_name(sid), storage=storage)
        return [t.number for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))]
    finally:
        storage.engine.dispose()


# ---- item 4: a runner that fails leaves nothing open -------------------------------------


def _refuse_metric_rows(db_url: str) -> None:
    """Every later metric insert fails (a bug or a broken table, not a dropped connection:
    nothing retries it), so the runner fails mid-study."""
    engine = make_engine(db_url)
    with engine.begin() as c:
        if db_url.startswith("sqlite"):
            c.execute(
                text(
                    "CREATE TRIGGER qk_refuse BEFORE INSERT ON qk_metric "
                    "BEGIN SELECT RAISE(ABORT, 'metric rows refused'); END"
                )
            )
        else:
            c.execute(
                text(
                    "CREATE FUNCTION qk_refuse() RETURNS trigger AS $$ BEGIN "
                    "RAISE EXCEPTION 'metric rows refused'; END $$ LANGUAGE plpgsql"
                )
            )
            c.execute(
                text(
                    "CREATE TRIGGER qk_refuse BEFORE INSERT ON qk_metric "
                    "FOR EACH ROW EXECUTE FUNCTION qk_refuse()"
                )
            )
    engine.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: the store contract
def test_a_failed_runner_ends_its_open_trials(
    app_client: TestClient, db_url: str, store: Store
) -> None:
    """Before: the study went FAILED and its QUEUED/RUNNING rows and RUNNING Optuna trials
    stayed open for ever (run_study never closed them, the reconciler skips FAILED)."""
    client = app_client
    r = client.post("/v1/studies", json=fault_spec(n_trials=4, steps=INTERRUPT_STEPS))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    deadline = time.monotonic() + 300
    running = False
    while not running and time.monotonic() < deadline:
        items = client.get(f"/v1/studies/{sid}/trials").json()["items"]
        running = any(t["state"] == "RUNNING" and t["last_step"] >= 20 for t in items)
        time.sleep(0.3)
    assert running, client.get(f"/v1/studies/{sid}").json()
    _refuse_metric_rows(db_url)
    final = wait_for(client, sid, {"COMPLETED", "FAILED"}, timeout=300)
    assert final["status"] == "FAILED" and "metric rows refused" in final["error"]
    assert _open_rows(store, sid) == []
    assert _running_optuna(db_url, sid) == []
    items = client.get(f"/v1/studies/{sid}/trials").json()["items"]
    assert any(t["state"] == "FAILED" and t["error"].startswith("study failed") for t in items)


# ---- item 5: a spec that asks for CUDA without GPUs ----------------------------------------


def test_the_reconciler_closes_what_a_failed_or_cut_off_study_left_open(
    db_url: str, store: Store, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """A runner that failed because the database did cannot end its trials; a cancel cut off
    half way leaves them open too. Before: the reconciler looked at live studies only, so
    those rows (and Optuna's RUNNING trials) stayed open for ever."""
    settings = Settings(database_url=db_url, ray_address=ray_head.dashboard_url, home=tmp_path)
    spec = StudySpec.model_validate(fault_spec(n_trials=4, steps=20))
    failed, _ = store.studies.create(spec)
    cut_off, _ = store.studies.create(spec)
    storage = optuna_storage(db_url)
    try:
        study = optuna.create_study(storage=storage, study_name=optuna_study_name(failed.id))
        for n in range(2):
            study.ask()
            store.trials.insert_queued(failed.id, n, {}, 0)
            store.trials.insert_queued(cut_off.id, n, {}, 0)
    finally:
        storage.engine.dispose()
    store.studies.set_status(failed.id, StudyStatus.RUNNING)
    assert store.studies.fail_live(failed.id, "OperationalError: the database went away")
    store.studies.cancel(cut_off.id)  # the status only, as a cancel that died after it
    assert len(_open_rows(store, failed.id)) == 2 and len(_open_rows(store, cut_off.id)) == 2
    reconcile(store, JobLauncher(ray_head.dashboard_url), settings)
    assert _open_rows(store, failed.id) == [] and _open_rows(store, cut_off.id) == []
    assert _running_optuna(db_url, failed.id) == []
    with store.sessions() as s:
        rows = list(s.scalars(select(Trial).where(Trial.study_id.in_((failed.id, cut_off.id)))))
    by_study = {(t.study_id, t.state, t.error) for t in rows}
    assert by_study == {
        (failed.id, "FAILED", "study failed: OperationalError: the database went away"),
        (cut_off.id, "CANCELLED", "study cancelled"),
    }
    assert store.studies.status(failed.id) == StudyStatus.FAILED  # statuses stay as they were
    assert store.studies.status(cut_off.id) == StudyStatus.CANCELLED


def test_cuda_without_gpus_is_refused_at_post(client: TestClient) -> None:
    """Before: accepted; every trial's worker failed before it started, and a fused study
    relaunched its workers for ever. Now a 422 names the field (a node that was given GPUs
    but has no CUDA fails its trials after `max_retries`: test_scheduler)."""
    spec = fault_spec(n_trials=2)
    spec["base"]["device"] = "cuda"
    spec["fuse"] = 2
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["resources.gpus"]


# ---- item 7: a cancel can be repeated ---------------------------------------------------------


def test_a_cancel_interrupted_half_way_is_finished_by_the_next(
    db_url: str, store: Store, pg_server: str
) -> None:
    """Before: the first cancel committed CANCELLED, then failed before closing the trials;
    a second cancel returned early (the study was terminal): open rows for ever."""
    row, _ = store.studies.create(StudySpec.model_validate(fault_spec(n_trials=2)))
    sid = row.id
    store.studies.set_status(sid, StudyStatus.RUNNING)
    storage = optuna_storage(db_url)
    study = optuna.create_study(storage=storage, study_name=optuna_study_name(sid))
    for n in range(2):
        study.ask()
        store.trials.insert_queued(sid, n, {}, 0)
    storage.engine.dispose()
    unreachable = pg_server.rsplit("/", 1)[0] + "/qkscope_no_such_database"
    with pytest.raises(Exception, match="qkscope_no_such_database"):
        cancel_study(store, None, sid, unreachable)
    assert store.studies.get(sid).status == StudyStatus.CANCELLED  # type: ignore[union-attr]
    assert len(_open_rows(store, sid)) == 2  # the half a failed cancel left
    out = cancel_study(store, None, sid, db_url)
    assert out is not None and out.status == StudyStatus.CANCELLED
    assert _open_rows(store, sid) == [] and _running_optuna(db_url, sid) == []


# ---- item 8: a submission whose answer is lost --------------------------------------------


def _swallowing_proxy(target_port: int) -> tuple[int, socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def pipe(client: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", target_port))
        try:
            while data := client.recv(65536):
                up.sendall(data)
        except OSError:
            pass

    def serve() -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=pipe, args=(client,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], srv


def test_a_submission_still_in_flight_is_not_judged_lost(
    db_url: str, store: Store, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """POST /v1/studies records the job id, then submits it from a thread while the
    reconciler runs on. A round that falls in between saw a recorded job Ray did not list yet
    and launched attempt 2 beside attempt 1 (found by test_db_outage_study under load; the
    fence kept it harmless, the second runner was waste). A young PENDING study's job is now
    given the job server's time to arrive; an old one is judged as before (here: given up,
    as max_job_attempts is 1)."""
    settings = Settings(
        database_url=db_url, ray_address=ray_head.dashboard_url, home=tmp_path, max_job_attempts=1
    )
    row, _ = store.studies.create(StudySpec.model_validate(fault_spec(n_trials=1, steps=20)))
    claimed = store.studies.claim_launch(row.id, 0, lambda i, a: f"qkscope-study-{i}-a{a}-inflight")
    assert claimed == (1, f"qkscope-study-{row.id}-a1-inflight")  # not in Ray yet
    launcher = JobLauncher(ray_head.dashboard_url)
    assert reconcile(store, launcher, settings) == 0
    after = store.studies.get(row.id)
    assert after is not None and after.status == StudyStatus.PENDING and after.job_attempts == 1
    assert reconcile(store, launcher, settings, grace_s=0) == 0  # judged now: out of attempts
    after = store.studies.get(row.id)
    assert after is not None and after.status == StudyStatus.FAILED


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: the store contract
def test_a_submission_whose_answer_was_lost_is_not_submitted_again(
    db_url: str, store: Store, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """Before: the job client timed out after Ray had accepted the job; the job id was
    never recorded and the attempt was given back, so the reconciler submitted a second
    runner for the same study. Now the id is recorded first, and found in Ray's list."""
    settings = Settings(database_url=db_url, ray_address=ray_head.dashboard_url, home=tmp_path)
    row, _ = store.studies.create(StudySpec.model_validate(fault_spec(n_trials=1, steps=20)))
    t0 = time.time() * 1000  # Ray's job times are in ms; earlier tests' studies are also "1"
    port = int(ray_head.dashboard_url.rsplit(":", 1)[1])
    proxy, srv = _swallowing_proxy(port)
    launcher = JobLauncher(ray_head.dashboard_url, timeout_s=5)
    launcher._client._address = f"http://127.0.0.1:{proxy}"  # the answer never comes back
    try:
        with pytest.raises(Exception, match="(?i)timed? ?out"):
            launch_study(store, launcher, settings, row.id, seen_attempts=0)
    finally:
        srv.close()
    recorded = store.studies.get(row.id)
    assert recorded is not None and recorded.ray_job_id and recorded.job_attempts == 1
    real = JobLauncher(ray_head.dashboard_url)
    deadline = time.monotonic() + 30
    while real.status(recorded.ray_job_id) is None and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray accepted it: it shows up under the recorded id
    assert real.status(recorded.ray_job_id) is not None
    # What the launch asks after a failed submission, as the real job server answers it.
    assert real.lookup(recorded.ray_job_id) in ("PENDING", "RUNNING", "SUCCEEDED", "FAILED")
    assert real.lookup(f"qkscope-study-{row.id}-a9-never") is None
    assert reconcile(store, real, settings, grace_s=0) == 0
    mine = [
        j
        for j in real.list_jobs()
        if (j.metadata or {}).get("qkscope_study") == str(row.id) and (j.start_time or 0) >= t0
    ]
    assert [j.submission_id for j in mine] == [recorded.ray_job_id]  # one runner, not two
    cancel_study(store, real, row.id, db_url)


# ---- item 9: a runner killed between Optuna's ask and our row ------------------------------


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: the store contract
def test_a_trial_asked_by_a_dead_runner_before_its_row_is_adopted_and_run(
    db_url: str, store: Store, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """Before: the next runner told Optuna FAIL and wrote no row: a trial number missing
    from our table and one trial of the budget spent. Now it is adopted: its row is
    written and it runs like any other."""
    settings = Settings(
        database_url=db_url,
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    row, _ = store.studies.create(StudySpec.model_validate(fault_spec(n_trials=3, steps=20)))
    store.studies.set_status(row.id, StudyStatus.RUNNING)
    storage = optuna_storage(db_url)
    optuna.create_study(storage=storage, study_name=optuna_study_name(row.id)).ask()
    storage.engine.dispose()  # the dead runner's ask: RUNNING in Optuna, no row of ours
    assert launch_study(store, JobLauncher(ray_head.dashboard_url), settings, row.id)
    deadline = time.monotonic() + 300
    while store.studies.status(row.id) == StudyStatus.RUNNING and time.monotonic() < deadline:
        time.sleep(0.5)
    trials = check_finished_study(db_url, row.id)  # each planned trial exactly once
    assert trials[0].number == 0 and trials[0].state == TrialState.COMPLETE


# ---- item 1: an end that arrives after its worker's end -------------------------------------


@ray.remote(num_cpus=0)
def _worker_that_hands_back_late(name: str, trials: list[int], inbox: Any) -> WorkerDone:
    """A slot worker whose hand-backs reach the inbox after its task has ended (a thread
    left behind in the reused Ray worker process sends them 1.5 s later)."""

    def late() -> None:
        time.sleep(1.5)
        for n in trials:
            inbox.ended.remote(HandedBack(name, n, 1))

    threading.Thread(target=late, daemon=True).start()
    return WorkerDone(name, "node", len(trials), 0)


class _Placements:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[int]]] = []

    def start(self, name: str, capacity: int, first: list[Assignment]) -> None:
        self.calls.append(("start", name, [a.trial for a in first]))

    def assign(self, name: str, items: list[Assignment]) -> None:
        self.calls.append(("assign", name, [a.trial for a in items]))

    def close(self, name: str) -> None:
        self.calls.append(("close", name, []))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_hand_backs_held_back_past_their_workers_end_place_nothing_twice(
    ray_head: LocalRayHead, db_url: str
) -> None:
    """The review's double-training race, through a real inbox and real Ray tasks: a worker's
    end is handled (its trials wait again and are placed in a new worker) before its late
    hand-backs arrive. Before: the hand-backs took the trials out of the new worker's book
    and requeued them, so a third worker trained them while the second still did."""
    ray.init(address=f"127.0.0.1:{ray_head.gcs_port}", log_to_driver=False)
    try:
        spec = StudySpec.model_validate(
            {"name": "late", "base": TINY, "budget": {"n_trials": 2}, "fuse": 2}
            | {"sampler": {"kind": "random"}}
        )
        pool = RayPool(spec)
        placements = _Placements()
        sched = Scheduler(spec, 1, placements)
        study = optuna.create_study()
        from workers.config import TrialConfig

        recs = []
        for _ in range(2):
            trial = study.ask()
            cfg = TrialConfig.model_validate(TINY)
            key, slots = slot_key(spec, cfg, trial.number)
            recs.append(TrialRecord(trial, trial.number, {}, cfg, key=key, slots=slots))
            sched.add(recs[-1])
        sched.schedule()
        w0 = recs[0].worker
        assert w0 is not None and recs[1].worker == w0
        ref = _worker_that_hands_back_late.remote(w0, [0, 1], pool.inbox)
        pool.refs[ref] = w0
        ended: list[Any] = []
        while not ended:
            batch, ended = pool.wait(1.0)
        assert not batch.ends  # the hand-backs are still on their way
        assert sched.worker_ended(w0, None) == []
        sched.schedule()
        w1 = recs[0].worker
        assert w1 not in (None, w0) and recs[1].worker == w1
        late: list[Any] = []
        deadline = time.monotonic() + 30
        while len(late) < 2 and time.monotonic() < deadline:
            late += pool.wait(1.0)[0].ends
        assert sorted(m.trial for m in late) == [0, 1]
        before = list(placements.calls)
        for msg in late:
            assert sched.ended(msg) is None
        sched.schedule()
        assert placements.calls == before  # nothing placed a second time
        assert [r.status for r in recs] == [Status.PLACED, Status.PLACED]
        assert {r.worker for r in recs} == {w1}
        pool.close_inbox()
    finally:
        ray.shutdown()


def _fence_actors() -> tuple[Any, Any]:
    """A slow inbox and a worker that stops a member and then breaks; made in a function so
    that Ray ships them by value (the test module is not importable in a Ray worker)."""

    class SlowInbox(TrialInbox):
        """The real inbox, with each member's end held back 2 s on its way in."""

        async def ended(self, msg: Any) -> None:
            await asyncio.sleep(2.0)
            await super().ended(msg)

    class StoppedMember:
        tag = 7
        summary = TrialSummary(status="completed", steps_done=40)

    class StopsThenBreaks(SlotWorker):
        """One member stops (its end is sent), then an error ends the whole task (as a
        step error with several members does)."""

        def run(self, first: list[Assignment]) -> WorkerDone:
            self.started[7] = time.time()
            self.reporters[7] = InboxReporter(self.inbox, 7)
            self._finished(StoppedMember())
            raise RuntimeError("a fused step failed with several members")

    def stop_then_break(inbox: Any) -> WorkerDone:
        return StopsThenBreaks("w0", 2, inbox).run_settled([])

    return ray.remote(num_cpus=0)(SlowInbox), ray.remote(num_cpus=0)(stop_then_break)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_worker_that_fails_ends_only_after_the_inbox_has_its_last_messages(
    ray_head: LocalRayHead, db_url: str
) -> None:
    """The fence holds on the error path too: a member that stopped before its worker's task
    failed is in the batch the runner reads with that task's end. Before, the error ended the
    task at once, the runner saw the end first, and the member (whose result was still on its
    way) was relaunched or, out of retries, FAILED although it had completed."""
    ray.init(address=f"127.0.0.1:{ray_head.gcs_port}", log_to_driver=False)
    try:
        spec = StudySpec.model_validate(
            {"name": "fence", "base": TINY, "budget": {"n_trials": 1}, "fuse": 2}
        )
        pool = RayPool(spec)
        slow_inbox, stop_then_break = _fence_actors()
        pool.inbox = slow_inbox.remote()
        pool._stream = pool.inbox.stream.options(num_returns="streaming").remote()
        ref = stop_then_break.remote(pool.inbox)
        pool.refs[ref] = "w0"
        ends: list[Any] = []
        ended: list[Any] = []
        while not ended:
            batch, ended = pool.wait(1.0)
            ends += batch.ends
        assert ended[0].error is not None and "several members" in ended[0].error
        assert [(type(m).__name__, m.trial) for m in ends] == [("Stopped", 7)]
        pool.close_inbox()
    finally:
        ray.shutdown()


# ---- item 3: a point of the search space that fails at run time -------------------------


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: the store contract
def test_a_search_space_point_that_fails_at_run_time_fails_one_trial_not_the_study(
    db_url: str, store: Store, ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """POST refuses such a space (service/spec/space.py); a stored spec that slipped past it (a
    huge space is checked on a sample; one stored before the check) must still not fail the
    whole study. Before: the runner's config for n_heads 3 raised and the study went FAILED."""
    settings = Settings(
        database_url=db_url,
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    body = fault_spec(n_trials=6, steps=20)
    # the endpoints 2 and 4 divide d_model 32 (what the spec's own check tries), 3 does not
    body["search_space"] = {"model.n_heads": {"type": "int", "low": 2, "high": 4}}
    body["sampler"] = {"kind": "random", "seed": 3}
    row, _ = store.studies.create(StudySpec.model_validate(body))  # not through POST
    assert launch_study(store, JobLauncher(ray_head.dashboard_url), settings, row.id)
    deadline = time.monotonic() + 300
    while store.studies.status(row.id) in (StudyStatus.PENDING, StudyStatus.RUNNING):
        assert time.monotonic() < deadline, "study did not end"
        time.sleep(0.5)
    assert store.studies.status(row.id) == StudyStatus.COMPLETED
    with store.sessions() as s:
        trials = list(s.scalars(select(Trial).where(Trial.study_id == row.id)))
    bad = [t for t in trials if t.params["model.n_heads"] == 3]
    good = [t for t in trials if t.params["model.n_heads"] != 3]
    assert len(trials) == 6 and bad and good  # the premise: the seed draws both
    assert all(t.state == TrialState.FAILED and "n_heads" in (t.error or "") for t in bad)
    assert all(t.state == TrialState.COMPLETE for t in good)
    assert _running_optuna(db_url, row.id) == []
