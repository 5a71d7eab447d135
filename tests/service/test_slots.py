"""Fused trials as slots, through the real service on a real local Ray head (`parallelism: 1`,
`fuse: 4`: one slot worker): a pruned trial is PRUNED in the API while trials that started
before it keep training, and its slot takes the next trial at once; after a SIGKILL of the
slot worker mid-study every trial ends once and no stopped trial trains past its stop."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.control.ray_cluster import LocalRayHead
from tests.service.helpers import wait_for, wild_and_calm, worker_pid
from tests.service.invariants import check_finished_study

pytestmark = [pytest.mark.cluster, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def _pruning_spec(steps: int) -> dict[str, Any]:
    """lr 0.001 learns far slower than 0.1: once two trials completed, the median pruner
    stops the slow ones early while the fast ones train on. 12 grid points, 4 slots."""
    spec = wild_and_calm(n_trials=12, steps=steps)
    spec["name"] = "slots-pruning"
    spec["base"]["eval_every"] = 20
    spec["search_space"] = {
        "optim.lr": {"type": "categorical", "choices": [0.1, 0.001]},
        "seed": {"type": "categorical", "choices": [1, 2, 3, 4, 5, 6]},
    }
    spec["pruner"] = {"kind": "median", "n_startup_trials": 2, "n_warmup_steps": 0}
    return spec


def _at(t: dict[str, Any], field: str) -> float:
    return datetime.fromisoformat(t[field]).timestamp()


def test_a_pruned_trial_frees_its_slot_while_the_others_train(
    app_client: TestClient, db_url: str
) -> None:
    client = app_client
    r = client.post("/v1/studies", json=_pruning_spec(steps=600))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    seen_live = None  # (pruned trial, a trial that started before it, still RUNNING)
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        items = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
        pruned = [t for t in items if t["state"] == "PRUNED"]
        for p in pruned:
            for q in items:
                if (
                    q["state"] == "RUNNING"
                    and q["started_at"] is not None
                    and _at(q, "started_at") <= _at(p, "started_at")
                ):
                    seen_live = (p["number"], q["number"])
        status = client.get(f"/v1/studies/{sid}").json()["status"]
        if seen_live is not None or status in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.2)
    assert seen_live is not None, "never saw a PRUNED trial beside a RUNNING one started earlier"
    final = wait_for(client, sid, {"COMPLETED", "FAILED"}, timeout=400)
    assert final["status"] == "COMPLETED", final["error"]
    trials = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
    pruned = [t for t in trials if t["state"] == "PRUNED"]
    assert pruned and all(t["last_step"] < 600 for t in pruned)
    # A freed slot took the next trial while an older trial was still training in the same
    # worker: some trial started after a trial was pruned and before another one finished.
    refilled = [
        (p["number"], n["number"], q["number"])
        for p in pruned
        for q in trials
        for n in trials
        if _at(q, "started_at") < _at(p, "finished_at") < _at(q, "finished_at")
        and _at(p, "finished_at") <= _at(n, "started_at") < _at(q, "finished_at")
    ]
    assert refilled, [(t["number"], t["state"], t["started_at"], t["finished_at"]) for t in trials]
    check_finished_study(db_url, sid)  # each once, Optuna agrees, nothing past a stop
    # Each member's own clock, not the worker's: a pruned member trained fewer steps in less
    # time than the completed ones, and its tokens/s is its own steps over its own time.
    for t in trials:
        full = client.get(f"/v1/trials/{t['id']}").json()
        s = full["summary"]
        tokens = s["steps_done"] * 8 * 16  # batch_size x seq_len of wild_and_calm
        assert s["tokens_per_s"] == pytest.approx(tokens / s["wall_time_s"], rel=0.02), t["number"]
    done = [t for t in trials if t["state"] == "COMPLETE"]
    assert max(t["duration_s"] for t in pruned) < min(t["duration_s"] for t in done)


def test_a_killed_slot_worker_loses_nothing_and_revives_no_stopped_trial(
    app_client: TestClient, db_url: str, ray_head: LocalRayHead
) -> None:
    """lr 10 members diverge in a few steps, lr 0.1 ones train; the worker is SIGKILLed while
    members train. Its open members resume in a new worker from their own checkpoints (their
    attempts count it); the diverged ones never train again."""
    client = app_client
    spec = wild_and_calm(n_trials=6, steps=480)
    spec["max_retries"] = 2
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    name = f"study-{sid}/worker-0"
    victims: list[int] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not victims:
        items = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
        training = [t for t in items if t["state"] == "RUNNING" and 40 <= t["last_step"] < 240]
        if training and (pid := worker_pid(ray_head.dashboard_url, name)) is not None:
            os.kill(pid, signal.SIGKILL)
            victims = [t["number"] for t in training]
        time.sleep(0.2)
    assert victims, "no member was seen training"
    final = wait_for(client, sid, {"COMPLETED", "FAILED"}, timeout=400)
    assert final["status"] == "COMPLETED", final["error"]
    trials = check_finished_study(db_url, sid)
    by_number = {t.number: t for t in trials}
    assert {t.state for t in trials} <= {"COMPLETE", "DIVERGED"}
    assert any(t.state == "DIVERGED" for t in trials)
    for n in victims:
        assert by_number[n].state == "COMPLETE", (n, by_number[n].state, by_number[n].error)
        assert by_number[n].attempts >= 2, (n, by_number[n].attempts)
    for t in trials:
        if t.state == "DIVERGED":  # stopped before the kill, and stays stopped
            assert t.summary["steps_done"] < 20, (t.number, t.summary["steps_done"])


def test_a_killed_slot_worker_revives_no_pruned_trial_and_asks_only_for_free_slots(
    app_client: TestClient, db_url: str, ray_head: LocalRayHead
) -> None:
    """TPE (a sampler that learns from results, so no look-ahead) with the median pruner: at
    no moment are more trials asked than the one worker has slots; once a trial was pruned,
    the worker is SIGKILLed while others train. The pruned trials stay exactly as they were
    (state, step, finish time); the interrupted ones resume and end once."""
    client = app_client
    spec = _pruning_spec(steps=480)
    spec["sampler"] = {"kind": "tpe", "seed": 0, "n_startup_trials": 12}
    spec["max_retries"] = 2
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    name = f"study-{sid}/worker-0"
    most_open = 0
    pruned_before: dict[int, tuple[str, int, str]] = {}
    victims: list[int] = []
    killed_at = 0.0
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        items = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
        most_open = max(most_open, sum(t["state"] in ("QUEUED", "RUNNING") for t in items))
        if not victims:
            pruned = [t for t in items if t["state"] == "PRUNED"]
            training = [t for t in items if t["state"] == "RUNNING" and 40 <= t["last_step"] < 300]
            if pruned and training and (pid := worker_pid(ray_head.dashboard_url, name)):
                pruned_before = {
                    t["number"]: (t["state"], t["last_step"], t["finished_at"]) for t in pruned
                }
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
                victims = [t["number"] for t in training]
        if client.get(f"/v1/studies/{sid}").json()["status"] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.2)
    assert victims, "never saw a pruned trial beside a training one"
    final = wait_for(client, sid, {"COMPLETED", "FAILED"}, timeout=400)
    assert final["status"] == "COMPLETED", final["error"]
    assert 1 <= most_open <= 4, most_open  # parallelism 1 x fuse 4: never more asked
    trials = check_finished_study(db_url, sid)
    after = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
    now = {t["number"]: (t["state"], t["last_step"], t["finished_at"]) for t in after}
    for n, was in pruned_before.items():
        assert now[n] == was, (n, was, now[n])
    by_number = {t.number: t for t in trials}
    for n in victims:
        t = by_number[n]
        assert t.state in ("COMPLETE", "PRUNED"), (n, t.error)
        # The API shows a trial RUNNING until its end is stored, and the median pruner stops
        # trials often: a victim whose member had already stopped when the kill landed keeps
        # its one attempt, and its (worker-clock) finish is before the kill. Every other one
        # was interrupted and resumed.
        fin = t.finished_at if t.finished_at.tzinfo else t.finished_at.replace(tzinfo=UTC)
        stopped_first = t.attempts == 1 and fin.timestamp() <= killed_at + 0.5
        assert t.attempts >= 2 or stopped_first, (n, t.attempts, t.finished_at, killed_at)
    assert any(by_number[n].attempts >= 2 for n in victims), "the kill interrupted nothing"
