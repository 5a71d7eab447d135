"""Fused studies through the real service on a real local Ray head: `fuse: 4` gives the same
trials (numbers, params, values, per-evaluation val_loss) as `fuse: 1`; every member keeps its
own rows, summary and state (a diverging member is DIVERGED, the others COMPLETE); a cancel
leaves no open trial in our table or in Optuna's storage."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient
from optuna.trial import TrialState as OptunaState
from sqlalchemy import select

from service.app import create_app
from service.control.ray_cluster import LocalRayHead
from service.spec import StudySpec
from service.store.models import Trial
from service.store.optuna import optuna_storage, optuna_study_name
from service.store.session import make_engine, make_sessionmaker
from tests.service.helpers import (
    assert_untouched,
    finished,
    job_attempts,
    kill_runner,
    progress,
    settings_for,
    small_quickstart,
    snapshot,
    wait_for,
    wait_until,
    wild_and_calm,
)
from tests.service.invariants import INTERRUPT_STEPS, check_finished_study, fault_spec

pytestmark = [pytest.mark.cluster, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]
REL_TOL = 1e-4


def run(client: TestClient, spec: dict[str, Any], timeout: float = 240) -> list[dict[str, Any]]:
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    final = wait_for(client, sid, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=timeout)
    assert final["status"] == "COMPLETED", final["error"]
    trials = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100, "sort": "number"})
    return sorted(trials.json()["items"], key=lambda t: t["number"])


def val_losses(client: TestClient, trial_id: int) -> list[tuple[int, float]]:
    rows = client.get(f"/v1/trials/{trial_id}/metrics", params={"name": "val_loss"}).json()
    return [(m["step"], m["value"]) for m in rows]


def quickstart_random(fuse: int) -> dict[str, Any]:
    """Quickstart's model and task at few steps, a seeded random sampler, CPU float32, and the
    QK init scales where fused and run-alone twins stay within 1e-4 (tests/workers)."""
    spec = small_quickstart(n_trials=4, steps=30)
    spec["base"].update(eval_every=10, device="cpu", dtype="float32")
    spec["search_space"]["model.qk_init_std"] = {
        "type": "float",
        "low": 0.02,
        "high": 0.2,
        "log": True,
    }
    spec["sampler"] = {"kind": "random", "seed": 7}
    spec["constraints"] = []
    spec.update(name=f"fuse-{fuse}", fuse=fuse, parallelism=1 if fuse > 1 else 2)
    return spec


def test_fuse_4_gives_the_trials_of_fuse_1(app_client: TestClient, db_url: str) -> None:
    alone = run(app_client, quickstart_random(1))
    fused = run(app_client, quickstart_random(4))
    assert [t["number"] for t in fused] == [t["number"] for t in alone] == [0, 1, 2, 3]
    for a, f in zip(alone, fused, strict=True):
        assert f["params"] == a["params"]
        assert f["state"] == a["state"] == "COMPLETE"
        assert abs(f["value"] - a["value"]) <= REL_TOL * abs(a["value"]), (a, f)
        va, vf = val_losses(app_client, a["id"]), val_losses(app_client, f["id"])
        assert [s for s, _ in vf] == [s for s, _ in va] == [10, 20, 30]
        for (_, x), (_, y) in zip(va, vf, strict=True):
            assert abs(x - y) <= REL_TOL * abs(x), (a["number"], va, vf)
    # The four members really were different trials, trained in one task.
    assert len({round(t["value"], 6) for t in fused}) == 4
    assert len({t["node"] for t in fused}) == 1
    check_finished_study(db_url, fused[0]["study_id"])


def refused_grid(fuse: int) -> dict[str, Any]:
    """A grid over dropout x seed: dropout is refused by the fused model (sigma-reparam, the
    refused config here before issue 34, is fused since)."""
    spec = quickstart_random(fuse)
    spec["search_space"] = {
        "model.dropout": {"type": "categorical", "choices": [0.0, 0.1]},
        "seed": {"type": "int", "low": 0, "high": 1, "grid": [0, 1]},
    }
    spec["sampler"] = {"kind": "grid", "seed": 0}
    spec["name"] = f"refused-{fuse}"
    return spec


def test_configs_the_fused_model_refuses_train_alone_in_a_fused_study(
    app_client: TestClient, db_url: str
) -> None:
    """With `fuse: 2`, dropout trials get one-slot workers that train them exactly as
    `fuse: 1` does (the plain runner); the others are fused. Found when the entropy-collapse
    reproduction ran through the service and its 12 sigma-reparam trials (then refused by the
    fused model) FAILED."""
    alone = {t["number"]: t for t in run(app_client, refused_grid(1))}
    fused = run(app_client, refused_grid(2))
    assert len(fused) == len(alone) == 4
    for f in fused:
        a = alone[f["number"]]
        assert f["params"] == a["params"]
        assert f["state"] == a["state"] == "COMPLETE", (f["error"], a["error"])
        if f["params"]["model.dropout"] > 0.0:
            assert f["value"] == a["value"]  # the same program, bit for bit on CPU
        else:
            assert abs(f["value"] - a["value"]) <= REL_TOL * abs(a["value"]), (a, f)
    check_finished_study(db_url, fused[0]["study_id"])


def test_every_member_has_its_own_rows_summary_and_state(
    app_client: TestClient, db_url: str, tmp_path: Path
) -> None:
    trials = run(app_client, wild_and_calm(n_trials=6, steps=40))
    wild = [t for t in trials if t["params"]["optim.lr"] == 10.0]
    calm = [t for t in trials if t["params"]["optim.lr"] == 0.1]
    assert len(wild) == len(calm) == 3  # the grid: both kinds in the fused groups
    assert {t["state"] for t in wild} == {"DIVERGED"}
    assert {t["state"] for t in calm} == {"COMPLETE"}
    for t in calm:
        detail = app_client.get(f"/v1/trials/{t['id']}").json()
        assert detail["summary"]["status"] == "completed"
        assert detail["summary"]["eval_steps"] == [10, 20, 30, 40]
        assert [s for s, _ in val_losses(app_client, t["id"])] == [10, 20, 30, 40]
        assert math.isfinite(t["value"])
    for t in wild:
        detail = app_client.get(f"/v1/trials/{t['id']}").json()
        assert detail["summary"]["status"] == "diverged"
        assert detail["summary"]["diverged_at_step"] is not None
        assert t["value"] is None
    # Each member's rows are its own: different seeds give different calm losses.
    assert len({round(t["value"], 6) for t in calm}) == 3
    # Each member checkpointed into its own directory.
    ckpt = tmp_path / "ckpt"
    sid = trials[0]["study_id"]
    for t in calm:
        assert any((ckpt / f"study-{sid}" / f"trial-{t['number']}").iterdir())
    check_finished_study(db_url, sid)


def test_cancel_of_a_fused_study_leaves_no_open_trial(app_client: TestClient, db_url: str) -> None:
    spec = wild_and_calm(n_trials=6, steps=20_000)
    spec["base"]["eval_every"] = 50
    spec["search_space"]["optim.lr"]["choices"] = [0.1, 0.05]  # nobody stops early
    r = app_client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    deadline = time.monotonic() + 240  # generous: a loaded machine starts Ray jobs slowly
    running = 0
    while time.monotonic() < deadline and running < 4:
        page = app_client.get(f"/v1/studies/{sid}/trials", params={"state": "RUNNING"}).json()
        running = page["total"]
        time.sleep(0.5)
    assert running == 4, (
        app_client.get(f"/v1/studies/{sid}").json(),
        app_client.get(f"/v1/studies/{sid}/trials").json(),
    )
    assert app_client.post(f"/v1/studies/{sid}/cancel").json()["status"] == "CANCELLED"
    wait_for(app_client, sid, {"CANCELLED"}, timeout=30)
    storage = optuna_storage(db_url)
    engine = make_engine(db_url)
    deadline = time.monotonic() + 60
    try:
        while True:  # the runner may still be closing its group when the API answers
            with make_sessionmaker(engine)() as s:
                states = {
                    t.number: t.state for t in s.scalars(select(Trial).where(Trial.study_id == sid))
                }
            study = optuna.load_study(study_name=optuna_study_name(sid), storage=storage)
            optuna_states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
            done = set(states.values()) == {"CANCELLED"}
            if (done and OptunaState.RUNNING not in optuna_states.values()) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.5)
    finally:
        engine.dispose()
    assert len(states) >= 4 and set(states.values()) == {"CANCELLED"}, states
    assert set(optuna_states) == set(states)
    assert set(optuna_states.values()) == {OptunaState.FAIL}, optuna_states


def test_a_pruned_member_stops_alone(app_client: TestClient, db_url: str) -> None:
    """The median pruner's answer reaches each member through the inbox like a single trial's:
    slow members of the second group are PRUNED early while their group mates go on."""
    spec = wild_and_calm(n_trials=8, steps=60)
    spec["search_space"] = {
        "optim.lr": {"type": "categorical", "choices": [0.1, 0.001]},
        "seed": {"type": "categorical", "choices": [1, 2, 3, 4]},
    }
    spec["pruner"] = {"kind": "median", "n_startup_trials": 2, "n_warmup_steps": 0}
    trials = run(app_client, spec)
    pruned = [t for t in trials if t["state"] == "PRUNED"]
    assert pruned, [(t["number"], t["params"], t["state"]) for t in trials]
    assert {t["state"] for t in trials} <= {"PRUNED", "COMPLETE"}
    assert any(t["state"] == "COMPLETE" for t in trials if t["number"] >= 4)  # a group mate
    for t in pruned:
        detail = app_client.get(f"/v1/trials/{t['id']}").json()
        assert detail["summary"]["status"] == "pruned"
        assert detail["summary"]["steps_done"] < 60
        assert t["number"] >= 4  # nothing is pruned before two trials completed
        # the runner's reason travelled with the stop to the member and back in its summary
        metric = StudySpec.model_validate(spec).objectives[0].metric
        assert detail["stop_reason"].startswith(f"median pruner: {metric} "), detail["stop_reason"]
        assert detail["summary"]["stop_reason"] == detail["stop_reason"]
    check_finished_study(db_url, trials[0]["study_id"])


@pytest.fixture
def reconciling(db_url: str, ray_head: LocalRayHead, tmp_path: Path) -> Iterator[TestClient]:
    """The API with its reconciler loop (it resubmits a study whose runner job died)."""
    with TestClient(create_app(settings_for(db_url, ray_head, tmp_path))) as client:
        yield client


def test_a_killed_runner_relaunches_fused_members_from_their_checkpoints(
    reconciling: TestClient, db_url: str, ray_head: LocalRayHead
) -> None:
    """test_restarts' runner kill with `fuse: 2`: the dead runner's groups die with it; the
    resubmitted runner regroups the open trials, each member resumes from its own checkpoint,
    and completed members are not run again."""
    client = reconciling

    def get(path: str) -> Any:
        r = client.get(path)
        assert r.status_code == 200, r.text
        return r.json()

    spec = {**fault_spec(n_trials=6, steps=INTERRUPT_STEPS), "fuse": 2}
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid, job_id = r.json()["id"], r.json()["ray_job_id"]
    seen = wait_until("progress", lambda: progress(get, sid))
    before = snapshot(seen["done"])
    kill_runner(ray_head, job_id)
    study = wait_until("study end", lambda: finished(get, sid), timeout=400)
    assert study["status"] == "COMPLETED", study["error"]
    assert job_attempts(db_url, sid) >= 2
    trials = check_finished_study(db_url, sid)
    assert {t.state for t in trials} == {"COMPLETE"}
    assert_untouched(before, trials)
    interrupted = {t["number"] for t in seen["running"]}
    assert all(t.attempts >= 2 for t in trials if t.number in interrupted), (
        interrupted,
        [(t.number, t.attempts, t.started_at, t.finished_at) for t in trials],
    )
