"""Fused trials as slots, through the real service on a real local Ray head (`parallelism: 1`,
`fuse: 4`: one slot worker). The suite's prune scenario: a pruned member is PRUNED in the API
with the pruner's reason while trials that started before it keep training, and its slot
takes the next trial at once. The suite's worker kill: after a SIGKILL of the slot worker
mid-study every trial ends once, the interrupted members resume from their own checkpoints,
and no stopped trial (diverged, or stopped as infeasible) trains past its stop."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.control.ray_cluster import LocalRayHead
from service.spec import StudySpec
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
    # The median pruner's answer reached each member through the inbox like a single trial's,
    # with its reason, and nothing was pruned before two trials had completed.
    metric = StudySpec.model_validate(_pruning_spec(steps=600)).objectives[0].metric
    first_two = sorted(_at(t, "finished_at") for t in done)[1]
    for t in pruned:
        detail = client.get(f"/v1/trials/{t['id']}").json()
        assert detail["summary"]["status"] == "pruned"
        assert detail["summary"]["steps_done"] < 600
        assert detail["stop_reason"].startswith(f"median pruner: {metric} "), detail["stop_reason"]
        assert detail["summary"]["stop_reason"] == detail["stop_reason"]
        assert _at(t, "finished_at") >= first_two


def _stopping_spec(steps: int) -> dict[str, Any]:
    """Every kind of stop in one fused study: lr 10 diverges within 10 steps (plain SGD, no
    clipping), a QK init scale of 3 collapses attention at the first evaluation (stopped as
    infeasible on `min_norm_entropy_ever`), lr 0.1 at scale 0.02 trains to the end. TPE (a
    sampler that learns from results: no look-ahead) draws the 8 trials at random."""
    spec = wild_and_calm(n_trials=8, steps=steps)
    spec["name"] = "slots-worker-kill"
    spec["search_space"] = {
        "optim.lr": {"type": "categorical", "choices": [0.1, 10.0]},
        "model.qk_init_std": {"type": "categorical", "choices": [0.02, 3.0]},
        "seed": {"type": "categorical", "choices": [1, 2, 3]},
    }
    spec["sampler"] = {"kind": "tpe", "seed": 0, "n_startup_trials": 8}
    spec["pruner"] = {"kind": "none", "stop_infeasible": True}
    spec["constraints"] = [{"metric": "min_norm_entropy_ever", "op": ">=", "value": 0.1}]
    spec["max_retries"] = 2
    return spec


def test_a_killed_slot_worker_loses_nothing_and_revives_no_stopped_trial(
    app_client: TestClient, db_url: str, ray_head: LocalRayHead
) -> None:
    """Once a member has stopped (diverged or infeasible), the slot worker is SIGKILLed while
    others train. The stopped trials stay exactly as they were (state, step, finish time,
    reason); the interrupted ones resume in a new worker from their own checkpoints (their
    attempts count it) and end once; at no moment are more trials asked than the worker has
    slots."""
    client = app_client
    r = client.post("/v1/studies", json=_stopping_spec(steps=480))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    name = f"study-{sid}/worker-0"
    most_open = 0
    stopped_before: dict[int, tuple[Any, ...]] = {}
    victims: list[int] = []
    killed_at = 0.0
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        items = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
        most_open = max(most_open, sum(t["state"] in ("QUEUED", "RUNNING") for t in items))
        if not victims:
            stopped = [t for t in items if t["state"] in ("PRUNED", "DIVERGED")]
            training = [t for t in items if t["state"] == "RUNNING" and 40 <= t["last_step"] < 240]
            if stopped and training and (pid := worker_pid(ray_head.dashboard_url, name)):
                stopped_before = {
                    t["number"]: (t["state"], t["last_step"], t["finished_at"], t["stop_reason"])
                    for t in stopped
                }
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
                victims = [t["number"] for t in training]
        if client.get(f"/v1/studies/{sid}").json()["status"] in ("COMPLETED", "FAILED"):
            break
        time.sleep(0.2)
    assert victims, "never saw a stopped trial beside a training one"
    final = wait_for(client, sid, {"COMPLETED", "FAILED"}, timeout=400)
    assert final["status"] == "COMPLETED", final["error"]
    assert 1 <= most_open <= 4, most_open  # parallelism 1 x fuse 4: never more asked
    trials = check_finished_study(db_url, sid)  # each once, Optuna agrees, rows all there
    after = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
    now = {t["number"]: t for t in after}
    for n, was in stopped_before.items():
        t = now[n]
        assert (t["state"], t["last_step"], t["finished_at"], t["stop_reason"]) == was, n
    states = {t.state for t in trials}
    assert states <= {"COMPLETE", "DIVERGED", "PRUNED"}, states
    assert {"COMPLETE", "DIVERGED", "PRUNED"} <= states, "the premise: every kind of end"
    for t in trials:
        if t.state == "DIVERGED":
            assert t.summary["steps_done"] < 20, (t.number, t.summary["steps_done"])
        if t.state == "PRUNED":
            assert t.feasible is False and t.stop_reason.startswith("min_norm_entropy_ever ")
    by_number = {t.number: t for t in trials}
    for n in victims:
        t = by_number[n]
        # The API shows a trial RUNNING until its end is stored: a victim whose member had
        # already stopped when the kill landed keeps its one attempt, and its (worker-clock)
        # finish is before the kill. Every other one was interrupted and resumed.
        fin = t.finished_at if t.finished_at.tzinfo else t.finished_at.replace(tzinfo=UTC)
        stopped_first = t.attempts == 1 and fin.timestamp() <= killed_at + 0.5
        assert t.attempts >= 2 or stopped_first, (n, t.attempts, t.finished_at, killed_at)
    resumed = [by_number[n] for n in victims if by_number[n].attempts >= 2]
    assert resumed and any(t.state == "COMPLETE" for t in resumed), "the kill interrupted nothing"
