"""Fused studies through the real service on a real local Ray head: `fuse: 4` gives the same
trials (numbers, params, values, per-evaluation val_loss) as `fuse: 1`; every member keeps its
own rows, summary and state (a diverging member is DIVERGED, the others COMPLETE); a cancel
leaves no open trial in our table or in Optuna's storage."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.service.helpers import (
    small_quickstart,
    wait_for,
    wild_and_calm,
)
from tests.service.invariants import check_finished_study

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
        assert "eval_steps" not in detail["summary"]  # read routes: the val_loss series below
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
