"""GET /v1/studies/{id}/importance, the `importance` plot kind, `Client.importance` and
`qkscope importance`, on SQLite and PostgreSQL. The seeded COMPLETE trials have a known
answer: min_norm_entropy is driven by model.qk_init_std, final_val_loss by
regularizer.lambda, and qk_eig_mean (kept only in the stored summary) by model.norm; a
fourth parameter (seed_noise) does nothing. Each evaluator must find the driver."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from qkscope import ApiError, Client
from service.config import Settings
from service.store.models import Trial
from tests.conftest import ROOT
from tests.service.conftest import TOKEN, create_via_api, live_api

SPACE: dict[str, Any] = {
    "regularizer.lambda": {"type": "float", "low": 0.0001, "high": 1.0, "log": True},
    "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
    "optim.weight_decay": {"type": "float", "low": 0.0, "high": 0.1},
}
N = 40


def seed_trials(engine: Engine, sid: int, n: int, states: tuple[str, ...] = ("COMPLETE",)) -> None:
    rng = random.Random(7)
    with Session(engine) as s:
        for i in range(n):
            lam = math.exp(rng.uniform(math.log(1e-4), 0.0))
            std = rng.uniform(0.02, 1.5)
            norm = rng.choice(["pre", "post"])
            wd = rng.uniform(0.0, 0.1)
            loss = 2.0 + 0.5 * math.log10(lam) ** 2 / 16 + rng.gauss(0, 0.002)
            s.add(
                Trial(
                    study_id=sid,
                    number=i,
                    state=states[i % len(states)],
                    params={
                        "regularizer.lambda": lam,
                        "model.qk_init_std": std,
                        "model.norm": norm,
                        "optim.weight_decay": wd,
                    },
                    value=loss,
                    values=[loss],
                    final_val_loss=loss,
                    min_norm_entropy=1.0 - 0.6 * std + rng.gauss(0, 0.002),
                    summary={"qk_eig_mean": (3.0 if norm == "post" else 0.5) + rng.gauss(0, 0.01)},
                )
            )
        s.commit()


@pytest.fixture(scope="module")
def sid(client: TestClient, engine: Engine) -> int:
    study = create_via_api(
        client, {"name": "imp", "budget": {"n_trials": N}, "search_space": SPACE}
    )
    seed_trials(engine, study, N, states=("COMPLETE", "COMPLETE", "COMPLETE", "PRUNED"))
    return study


def get(client: TestClient, sid: int, **params: Any) -> dict[str, Any]:
    r = client.get(f"/v1/studies/{sid}/importance", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize(
    ("target", "driver"),
    [
        ("min_norm_entropy", "model.qk_init_std"),
        ("final_val_loss", "regularizer.lambda"),
        ("value", "regularizer.lambda"),
        ("qk_eig_mean", "model.norm"),  # a metric kept only in the trial's stored summary
    ],
)
def test_fanova_finds_the_driver(client: TestClient, sid: int, target: str, driver: str) -> None:
    got = get(client, sid, target=target)
    assert got["evaluator"] == "fanova" and got["target"] == target
    assert got["n_trials"] == 30  # the COMPLETE ones; PRUNED trials are left out
    imp = got["importances"]
    assert set(imp) == set(SPACE)
    assert list(imp) == sorted(imp, key=lambda k: -imp[k])  # largest first
    assert sum(imp.values()) == pytest.approx(1.0)
    assert list(imp)[0] == driver and imp[driver] > 0.6, imp
    assert imp["optim.weight_decay"] < 0.1


def test_default_target_is_the_first_objective(client: TestClient, sid: int) -> None:
    got = get(client, sid)
    assert got["target"] == "final_val_loss" and got["direction"] == "minimize"
    assert list(got["importances"])[0] == "regularizer.lambda"


def test_ped_anova_finds_the_driver(client: TestClient, sid: int) -> None:
    got = get(client, sid, target="min_norm_entropy", evaluator="ped_anova", direction="maximize")
    assert got["evaluator"] == "ped_anova" and got["direction"] == "maximize"
    assert list(got["importances"])[0] == "model.qk_init_std", got


def test_bad_requests_name_the_field(client: TestClient, sid: int, engine: Engine) -> None:
    r = client.get(f"/v1/studies/{sid}/importance", params={"target": "bogus_metric"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "target", r.text
    assert "min_norm_entropy" in r.json()["message"]  # it lists what would work
    r = client.get(f"/v1/studies/{sid}/importance", params={"evaluator": "shap"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "evaluator", r.text
    assert client.get("/v1/studies/999999/importance").status_code == 404
    few = create_via_api(client, {"name": "few", "budget": {"n_trials": 9}, "search_space": SPACE})
    seed_trials(engine, few, 4)
    r = client.get(f"/v1/studies/{few}/importance")
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "too_few_trials" and body["errors"][0]["field"] == "target"
    assert "at least 5" in body["message"] and "has 4" in body["message"]


def test_importance_plot(client: TestClient, sid: int, engine: Engine) -> None:
    r = client.get(f"/v1/studies/{sid}/plots/importance", params={"target": "min_norm_entropy"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content[:8] == b"\x89PNG\r\n\x1a\n"
    data = client.get(
        f"/v1/studies/{sid}/plots/importance",
        params={"target": "min_norm_entropy", "format": "json"},
    ).json()
    api = get(client, sid, target="min_norm_entropy")
    assert [(b["param"], b["importance"]) for b in data["bars"]] == list(api["importances"].items())
    r = client.get(f"/v1/studies/{sid}/plots/importance", params={"target": "nope"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "target"
    empty = create_via_api(client, {"name": "e", "budget": {"n_trials": 9}, "search_space": SPACE})
    data = client.get(f"/v1/studies/{empty}/plots/importance", params={"format": "json"}).json()
    assert data["bars"] == [] and "at least 5" in data["note"]
    png = client.get(f"/v1/studies/{empty}/plots/importance")
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_client_and_cli(
    app_settings: Settings, sid: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with live_api(app_settings, monkeypatch) as url:
        with Client(url, token=TOKEN) as qk:
            imp = qk.importance(sid, target="min_norm_entropy")
            assert imp.n_trials == 30 and next(iter(imp.importances)) == "model.qk_init_std"
            with pytest.raises(ApiError) as e:
                qk.importance(sid, target="bogus")
            assert e.value.status == 422 and e.value.field == "target"
            plot = qk.plot(sid, "importance", target="min_norm_entropy")
            assert plot.png[:8] == b"\x89PNG\r\n\x1a\n"
        env = {"PYTHONPATH": str(ROOT), "QKSCOPE_API_URL": url, "QKSCOPE_API_TOKEN": TOKEN,
               "PATH": "/usr/bin:/bin"}  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", "importance", str(sid), "--target",
             "min_norm_entropy"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert "importance for min_norm_entropy (fanova, 30 finished trials)" in lines[0]
        assert lines[1].split()[0] == "model.qk_init_std" and len(lines) == 1 + len(SPACE)


def complete_another(engine: Engine, study: int, number: int) -> None:
    """Another trial of the study completes (and one is pruned, which changes no ranking)."""
    with Session(engine) as s:
        params = s.scalars(select(Trial.params).where(Trial.study_id == study).limit(1)).one()
        s.add(
            Trial(
                study_id=study,
                number=number,
                state="COMPLETE",
                params=dict(params),
                value=2.0,
                values=[2.0],
                final_val_loss=2.0,
                min_norm_entropy=0.5,
                summary={},
            )
        )
        s.add(Trial(study_id=study, number=number + 1, state="PRUNED", params={}, summary={}))
        s.commit()


def test_a_ranking_is_reused_until_another_trial_completes(
    client: TestClient, engine: Engine
) -> None:
    """Issue 24: the importance panel recomputed fANOVA on every load (1.88 s at 10,000
    trials); now a study's ranking is cached and recomputed once a trial completes."""
    study = create_via_api(
        client, {"name": "imp-cache", "budget": {"n_trials": 30}, "search_space": SPACE}
    )
    seed_trials(engine, study, 12)
    cache = client.app.state.importance  # type: ignore[attr-defined]
    hits, misses = cache.hits, cache.misses
    first = get(client, study, target="min_norm_entropy")
    again = get(client, study, target="min_norm_entropy")
    assert again == first and (cache.hits, cache.misses) == (hits + 1, misses + 1)
    complete_another(engine, study, 12)
    after = get(client, study, target="min_norm_entropy")
    assert after["n_trials"] == first["n_trials"] + 1 and cache.misses == misses + 2
    assert (
        get(client, study, target="min_norm_entropy", evaluator="ped_anova")["evaluator"]
        == "ped_anova"
    )
    assert cache.misses == misses + 3  # another evaluator: another entry


def test_the_importance_plot_shares_the_cache(client: TestClient, engine: Engine) -> None:
    """The `importance` plot kind reads the same cache as /importance (app.state.importance):
    served again it does not recompute, and it recomputes once another trial completes."""
    study = create_via_api(
        client, {"name": "imp-plot-cache", "budget": {"n_trials": 30}, "search_space": SPACE}
    )
    seed_trials(engine, study, 12)
    cache = client.app.state.importance  # type: ignore[attr-defined]
    hits, misses = cache.hits, cache.misses
    url, params = f"/v1/studies/{study}/plots/importance", {"target": "min_norm_entropy"}
    first = client.get(url, params={**params, "format": "json"}).json()
    assert (cache.hits, cache.misses) == (hits, misses + 1)
    png = client.get(url, params=params)
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert (cache.hits, cache.misses) == (hits + 1, misses + 1)  # served again: no recompute
    api = get(client, study, target="min_norm_entropy")  # the route shares the entry
    assert (cache.hits, cache.misses) == (hits + 2, misses + 1)
    assert [(b["param"], b["importance"]) for b in first["bars"]] == list(
        api["importances"].items()
    )
    complete_another(engine, study, 12)
    after = client.get(url, params={**params, "format": "json"}).json()
    assert after["n_trials"] == first["n_trials"] + 1 and cache.misses == misses + 2
