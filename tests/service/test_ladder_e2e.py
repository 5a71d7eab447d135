"""A width ladder end to end on a real local Ray head: the grid runs, the runner adds the
bisection trials (service/runner/ladder.py) until every defined bracket is within the
factor, the study ends on its own before its budget, and GET .../stability-boundary reads
the trials it added. Small on purpose (2 widths x 3 learning rates, one seed, 40 steps)."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from service.control.ray_cluster import LocalRayHead
from tests.service.helpers import wait_for

pytestmark = pytest.mark.cluster

GRID = [0.003, 0.1, 10.0]
FACTOR = 4.0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: the store contract
def test_the_ladder_bisects_after_the_grid(
    app_client: TestClient, db_url: str, ray_head: LocalRayHead
) -> None:
    spec = {
        "name": "ladder-e2e",
        "base": {
            "task": {"kind": "associative_recall", "seq_len": 16, "n_pairs": 4,
                     "n_symbols": 8, "n_valid": 32},
            "model": {"n_layers": 1, "n_heads": 2, "d_model": 16, "d_ff": 32},
            "optim": {"warmup_steps": 0, "schedule": "constant"},
            "batch_size": 16, "steps": 40, "eval_every": 20, "eval_at_init": True,
            "eval_batches": 1, "device": "cpu", "seed": 0,
        },
        "search_space": {
            "optim.lr": {"type": "float", "low": 1e-3, "high": 10.0, "log": True, "grid": GRID},
            "model.d_model": {"type": "categorical", "choices": [16, 32]},
        },
        "sampler": {"kind": "grid", "seed": 0},
        "budget": {"n_trials": 20},
        "parallelism": 2,
        "stability": {"bisect_factor": FACTOR},
        "resources": {"cpus": 1, "gpus": 0},
    }  # fmt: skip
    r = app_client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    final = wait_for(app_client, sid, {"COMPLETED", "FAILED"}, timeout=420)
    assert final["status"] == "COMPLETED", final["error"]
    trials = app_client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
    off_grid = [
        t for t in trials if not any(math.isclose(t["params"]["optim.lr"], g) for g in GRID)
    ]
    assert len(trials) == 6 + len(off_grid) < spec["budget"]["n_trials"]  # it stopped itself
    assert all(GRID[0] < t["params"]["optim.lr"] < GRID[-1] for t in off_grid)
    body = app_client.get(f"/v1/studies/{sid}/stability-boundary").json()
    (group,) = body["groups"]
    points = group["points"]
    assert len(points) == 2 and sum(p["bisection_steps"] for p in points) == len(off_grid)
    defined = [p for p in points if p["eta_max"] is not None]
    assert defined, points  # 10 is far past the boundary of a 1-layer model
    for p in defined:
        assert p["ratio"] <= FACTOR * (1 + 1e-9)
        assert p["bisection_steps"] >= 1  # the grid's brackets are 33x and 100x wide
        # each bisection trial sits at the geometric middle of a bracket of the grid's points
        # and the earlier ones: the final bracket's ends are among the learning rates tried
        tried = {
            t["params"]["optim.lr"] for t in trials if t["params"]["model.d_model"] == p["width"]
        }
        assert any(math.isclose(p["eta_s"], e) for e in tried)
        assert any(math.isclose(p["eta_u"], e) for e in tried)
