"""optuna-dashboard on qkscope's database (real SQLite and PostgreSQL).

A study is submitted through the API; its trials are then run the way the study runner (service/runner/) runs
them (Optuna ask/tell on RDBStorage in the same database, study name `qkscope-<id>`, the
spec's sampler, constraints via `Trial.set_constraint`, the `qkscope_status` user attribute,
and the matching qk_trial rows), but with the training replaced by numbers made here. Then
optuna-dashboard's own code reads that database: its storage-URL loader (what
`optuna-dashboard <database url>` calls), its study and trial loaders, and its WSGI app's JSON
API (what the browser fetches); every trial, value, parameter and intermediate value must match
what was told, and qkscope's tables must not disturb its schema check.
"""

from __future__ import annotations

import json
import math
import wsgiref.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient
from optuna.trial import TrialState as OptunaState
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from service.app import create_app
from service.config import Settings
from service.runner.search import make_pruner, make_sampler
from service.spec import StudySpec
from service.store.models import Trial
from service.store.optuna import optuna_study_name
from service.store.session import make_engine, normalize_url

optuna_dashboard = pytest.importorskip("optuna_dashboard")

SPACE: dict[str, Any] = {
    "regularizer.lambda": {"type": "float", "low": 0.0001, "high": 1.0, "log": True},
    "model.n_layers": {"type": "int", "low": 1, "high": 4},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
}
N_TRIALS = 8
PRUNED, FAILED = 5, 6  # trial numbers that end otherwise


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(database_url=db_url, ray_address="", api_tokens="", home=tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False)) as c:
        yield c


@pytest.fixture
def engine(client: TestClient, db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def fake_result(params: dict[str, Any]) -> tuple[float, float]:
    """Stands in for training: a deterministic (final_val_loss, min_norm_entropy)."""
    lam, layers = params["regularizer.lambda"], params["model.n_layers"]
    loss = 1.0 + abs(math.log10(lam) + 2.0) / 4 + layers / 10 + (params["model.norm"] == "post") / 5
    return loss, 0.4 - layers / 20 + lam / 10


def run_like_the_runner(
    url: str, engine: Engine, study_id: int, spec: StudySpec
) -> dict[int, dict[str, Any]]:
    storage = optuna.storages.RDBStorage(normalize_url(url))
    study = optuna.create_study(
        storage=storage,
        study_name=optuna_study_name(study_id),
        directions=spec.directions(),  # type: ignore[arg-type]
        sampler=make_sampler(spec),
        pruner=make_pruner(spec),
        load_if_exists=True,
    )
    told: dict[int, dict[str, Any]] = {}
    for _ in range(N_TRIALS):
        trial = study.ask()
        params: dict[str, Any] = {}
        for path, p in spec.search_space.items():
            if p.type == "categorical":
                params[path] = trial.suggest_categorical(path, p.choices)
            elif p.type == "float":
                params[path] = trial.suggest_float(path, p.low, p.high, log=p.log)
            elif p.type == "int":
                params[path] = trial.suggest_int(path, p.low, p.high, log=p.log, step=p.step)
        loss, entropy = fake_result(params)
        # Intermediate values (the pruners' input) exist for single-objective studies only.
        curve = {0: loss + 1.0, 50: loss + 0.5, 100: loss} if len(spec.objectives) == 1 else {}
        for step, v in curve.items():
            trial.report(v, step)
        metrics = {"final_val_loss": loss, "min_norm_entropy": entropy}
        values = [metrics[o.metric] for o in spec.objectives]
        violations = [c.violation(metrics, 100) for c in spec.constraints]
        for i, (c, v) in enumerate(zip(spec.constraints, violations, strict=True)):
            trial.set_constraint(f"{i}:{c.metric}{c.op}", v)
        n = trial.number
        status = {PRUNED: "pruned", FAILED: "failed"}.get(n, "completed")
        if status != "failed":
            trial.set_user_attr("qkscope_status", status)
        state = {"pruned": "PRUNED", "failed": "FAILED"}.get(status, "COMPLETE")
        with Session(engine) as s:
            s.add(
                Trial(
                    study_id=study_id,
                    number=n,
                    state=state,
                    params=params,
                    values=None if status == "failed" else values,
                    value=None if status == "failed" else values[0],
                    feasible=None if status == "failed" else all(v <= 0 for v in violations),
                    final_val_loss=loss,
                    min_norm_entropy=entropy,
                )
            )
            s.commit()
        if status == "pruned":
            study.tell(trial, state=OptunaState.PRUNED)
        elif status == "failed":
            study.tell(trial, state=OptunaState.FAIL)
        else:
            study.tell(trial, values)
        told[n] = {
            "params": params,
            "values": values,
            "state": state,
            "curve": curve,
            "violations": violations,
        }
    return told


def wsgi_get(app: Any, path: str, query: str = "") -> tuple[str, dict[str, str], bytes]:
    environ: dict[str, Any] = {}
    wsgiref.util.setup_testing_defaults(environ)
    environ.update(REQUEST_METHOD="GET", PATH_INFO=path, QUERY_STRING=query)
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        got["status"], got["headers"] = status, dict(headers)
        return lambda _data: None

    body = b"".join(app(environ, start_response))
    return got["status"], got["headers"], body


SINGLE: dict[str, Any] = {
    "name": "dash-single",
    "budget": {"n_trials": N_TRIALS},
    "search_space": SPACE,
    "sampler": {"kind": "tpe", "seed": 3, "n_startup_trials": 4},
    "constraints": [{"metric": "min_norm_entropy", "op": ">=", "value": 0.25}],
}
MULTI: dict[str, Any] = {
    "name": "dash-multi",
    "budget": {"n_trials": N_TRIALS},
    "search_space": SPACE,
    "sampler": {"kind": "nsga2", "seed": 5},
    "objectives": [
        {"metric": "final_val_loss", "direction": "minimize"},
        {"metric": "min_norm_entropy", "direction": "maximize"},
    ],
}


@pytest.mark.parametrize("body", [SINGLE, MULTI], ids=["single", "multi"])
def test_optuna_dashboard_reads_a_qkscope_study(
    client: TestClient, engine: Engine, db_url: str, body: dict[str, Any]
) -> None:
    from optuna_dashboard._inmemory_cache import InMemoryCache
    from optuna_dashboard._storage import get_studies, get_study, get_trials
    from optuna_dashboard._storage_url import get_storage

    r = client.post("/v1/studies", json=body)
    assert r.status_code == 201, r.text
    created = r.json()
    sid, name = created["id"], created["optuna_study_name"]
    assert name == f"qkscope-{sid}"
    spec = StudySpec.model_validate(created["spec"])
    told = run_like_the_runner(db_url, engine, sid, spec)
    assert {t["state"] for t in told.values()} == {"COMPLETE", "PRUNED", "FAILED"}

    # What `optuna-dashboard <database url>` does with its argument.
    storage = get_storage(db_url)
    assert isinstance(storage, optuna.storages.RDBStorage)
    studies = {s.study_name: s for s in get_studies(storage)}
    assert name in studies
    frozen = get_study(storage, studies[name]._study_id)
    assert frozen is not None
    assert [d.name.lower() for d in frozen.directions] == spec.directions()
    trials = get_trials(InMemoryCache(), storage, frozen._study_id)
    assert [t.number for t in trials] == list(range(N_TRIALS))
    states = {"COMPLETE": OptunaState.COMPLETE, "PRUNED": OptunaState.PRUNED,
              "FAILED": OptunaState.FAIL}  # fmt: skip
    for t in trials:
        want = told[t.number]
        assert t.state == states[want["state"]]
        assert t.params == want["params"]
        assert t.intermediate_values == want["curve"]
        if want["state"] == "COMPLETE":
            assert t.values == want["values"]
            assert t.user_attrs == {"qkscope_status": "completed"}
        elif want["state"] == "PRUNED" and want["curve"]:
            assert t.values == [want["curve"][100]]  # Optuna keeps the last reported value
        else:
            assert t.values is None

    # The same trials as qkscope's own results API says.
    ours = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
    assert [(x["number"], x["state"], x["params"]) for x in ours] == [
        (n, told[n]["state"], told[n]["params"]) for n in range(N_TRIALS)
    ]

    # The dashboard's WSGI app: the JSON its web page fetches, and no schema complaint.
    app = optuna_dashboard.wsgi(db_url)
    status, headers, _ = wsgi_get(app, "/dashboard")
    assert status.startswith("200"), (status, headers.get("Location"))
    status, _, raw = wsgi_get(app, "/api/studies")
    assert status.startswith("200")
    listed = {s["study_name"]: s for s in json.loads(raw)["study_summaries"]}
    assert listed[name]["directions"] == spec.directions()
    status, _, raw = wsgi_get(app, f"/api/studies/{listed[name]['study_id']}")
    assert status.startswith("200"), raw[:300]
    detail = json.loads(raw)
    assert detail["name"] == name
    assert [t["number"] for t in detail["trials"]] == list(range(N_TRIALS))
    for t in detail["trials"]:
        want = told[t["number"]]
        assert t["state"] == {"FAILED": "Fail"}.get(want["state"], want["state"].capitalize())
        assert {p["name"]: p["param_external_value"] for p in t["params"]} == {
            k: str(v) for k, v in want["params"].items()
        }
        assert {iv["step"]: iv["value"] for iv in t["intermediate_values"]} == want["curve"]
        if want["state"] == "COMPLETE":
            assert t["values"] == want["values"]
        # optuna-dashboard 0.21 reads constraints from the `constraints` system attribute of
        # Optuna's old constraints_func; Optuna 5's Trial.set_constraint (what the runner uses)
        # keeps one `constraints:<key>` attribute each, so the page shows none (README).
        assert t["constraints"] == []
    if spec.constraints:
        for t in trials:
            assert {k: v for k, v in t.system_attrs.items() if k.startswith("constraints:")} == {
                f"constraints:{i}:{c.metric}{c.op}": v
                for i, (c, v) in enumerate(
                    zip(spec.constraints, told[t.number]["violations"], strict=True)
                )
            }
    complete = {n: w for n, w in told.items() if w["state"] == "COMPLETE"}
    best = sorted(t["number"] for t in detail["best_trials"])
    if len(spec.objectives) == 1:
        # The dashboard's best trial is the storage's (constraints not considered): the
        # lowest value of any COMPLETE trial, i.e. qkscope's /best with feasible_only=false.
        assert best == [min(complete, key=lambda n: complete[n]["values"][0])]
        feasible = {all(v <= 0 for v in w["violations"]) for w in complete.values()}
        assert feasible == {True, False}  # the constraint splits the trials
        ours_any = client.get(f"/v1/studies/{sid}/best", params={"feasible_only": False}).json()
        assert [t["number"] for t in ours_any] == best
    else:
        ours_best = client.get(f"/v1/studies/{sid}/best", params={"feasible_only": False}).json()
        assert best == sorted(t["number"] for t in ours_best)
