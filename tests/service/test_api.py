"""The REST API end to end on real SQLite and PostgreSQL databases (no Ray: studies stay PENDING).

One app per database for the module; trials and metrics are seeded with the ORM into studies
created through the API, and every expectation is computed independently (Python or plain SQL).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session

from service.app import create_app
from service.config import Settings
from service.spec import StudySpec
from service.store.models import Metric, Study, Trial
from service.store.session import make_engine

SPACE: dict[str, Any] = {
    "regularizer.lambda": {"type": "float", "low": 0.0001, "high": 1.0, "log": True},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
}

YAML_SPEC = """\
name: yaml-study
description: submitted as YAML
base:
  task: {kind: associative_recall, seq_len: 32, n_pairs: 4}
  steps: 200
search_space:
  regularizer.lambda: {type: float, low: 0.0001, high: 1.0, log: true}
  model.norm: {type: categorical, choices: [pre, post]}
budget: {n_trials: 8}
"""


def spec(name: str = "api-test", n_trials: int = 3, **extra: Any) -> dict[str, Any]:
    return {"name": name, "budget": {"n_trials": n_trials}, "search_space": SPACE, **extra}


def settings(url: str, tmp: Path, **kw: Any) -> Settings:
    """Explicit values so a developer's QKSCOPE_* environment cannot leak into the tests."""
    return Settings(database_url=url, ray_address="", api_tokens="", home=tmp, **kw)


# --- fixtures: one database and one app per database for the whole module -------------------


@pytest.fixture(scope="module")
def mod_db(module_db_url: str) -> str:
    return module_db_url


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def client(mod_db: str, home: Path) -> Iterator[TestClient]:
    app = create_app(settings(mod_db, home), reconcile_loop=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def engine(client: TestClient, mod_db: str) -> Iterator[Engine]:
    """A separate engine for independent checks (the app's lifespan has migrated by now)."""
    eng = make_engine(mod_db)
    yield eng
    eng.dispose()


def n_studies(engine: Engine, **where: Any) -> int:
    q = select(func.count()).select_from(Study)
    for k, v in where.items():
        q = q.where(getattr(Study, k) == v)
    with Session(engine) as s:
        return int(s.scalar(q) or 0)


def post(
    client: TestClient,
    body: dict[str, Any] | str | bytes,
    ctype: str = "application/json",
    **headers: str,
) -> Any:
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return client.post("/v1/studies", content=content, headers={"content-type": ctype, **headers})


def create(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = post(client, body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def assert_space_echoed(stored: dict[str, Any]) -> None:
    """The stored search space is the submitted one, with defaults (grid, log) filled in."""
    assert set(stored["search_space"]) == set(SPACE)
    for path, param in SPACE.items():
        assert stored["search_space"][path].items() >= param.items(), path


def fields(r: Any) -> list[str]:
    return [e["field"] for e in r.json()["errors"]]


def assert_error_shape(r: Any, status: int, error: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error", "message", "errors"}, body
    assert isinstance(body["message"], str) and body["message"]
    assert all(set(e) == {"field", "message"} for e in body["errors"])
    if error is not None:
        assert body["error"] == error, body
    return dict(body)


# --- POST /v1/studies -----------------------------------------------------------------------


def test_post_json_and_yaml_create_pending_studies_echoing_the_spec(
    client: TestClient, engine: Engine
) -> None:
    before = n_studies(engine)
    body = spec("json-study", n_trials=5, description="submitted as JSON")
    r = post(client, body)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["status"] == "PENDING" and out["n_trials"] == 5 and out["name"] == "json-study"
    assert out["ray_job_id"] is None and out["job_attempts"] == 0 and out["error"] is None
    assert out["optuna_study_name"] == f"qkscope-{out['id']}"
    assert out["started_at"] is None and out["finished_at"] is None
    # The stored spec is the validated spec with defaults filled in.
    expected = StudySpec.model_validate(body).model_dump(mode="json", by_alias=True)
    assert out["spec"] == expected
    assert_space_echoed(out["spec"])
    assert out["spec"]["description"] == "submitted as JSON"

    ry = post(client, YAML_SPEC, "application/yaml")
    assert ry.status_code == 201, ry.text
    y = ry.json()
    assert y["status"] == "PENDING" and y["name"] == "yaml-study" and y["n_trials"] == 8
    assert y["spec"]["base"]["steps"] == 200 and y["spec"]["base"]["task"]["n_pairs"] == 4
    assert_space_echoed(y["spec"])
    assert y["id"] != out["id"]

    # text/plain is read as YAML; no content type at all defaults to JSON.
    rt = post(client, YAML_SPEC.replace("yaml-study", "plain-study"), "text/plain; charset=utf-8")
    assert rt.status_code == 201, rt.text
    assert rt.json()["name"] == "plain-study"
    rn = client.post("/v1/studies", content=json.dumps(spec("no-ctype")).encode())
    assert rn.status_code == 201, rn.text

    assert n_studies(engine) == before + 4
    with Session(engine) as s:
        row = s.get(Study, out["id"])
        assert row is not None and row.status == "PENDING" and row.spec == expected
    assert client.get(f"/v1/studies/{out['id']}").json() == out


def test_yaml_and_json_of_the_same_definition_store_the_same_spec(client: TestClient) -> None:
    import yaml

    as_json = create(client, yaml.safe_load(YAML_SPEC))
    r = post(client, YAML_SPEC, "application/yaml")
    assert r.status_code == 201
    assert r.json()["spec"] == as_json["spec"]


def test_idempotency_key_returns_the_same_study_and_writes_one_row(
    client: TestClient, engine: Engine
) -> None:
    key = f"key-{uuid.uuid4().hex}"
    first = post(client, spec("idem"), **{"Idempotency-Key": key})
    assert first.status_code == 201, first.text
    again = post(client, spec("idem"), **{"Idempotency-Key": key})
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first.json()["id"]
    assert again.json() == first.json()
    # Same key, different body: the stored study is returned unchanged (no second row).
    other = post(client, spec("idem-other", n_trials=2), **{"Idempotency-Key": key})
    assert other.status_code == 200 and other.json()["id"] == first.json()["id"]
    assert other.json()["name"] == "idem"
    assert n_studies(engine, idempotency_key=key) == 1
    fresh = post(client, spec("idem"), **{"Idempotency-Key": key + "-2"})
    assert fresh.status_code == 201 and fresh.json()["id"] != first.json()["id"]
    too_long = post(client, spec("idem"), **{"Idempotency-Key": "k" * 201})
    assert_error_shape(too_long, 422, "validation_error")


BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("missing name", {"budget": {"n_trials": 3}}, "name"),
    ("missing budget", {"name": "t"}, "budget"),
    ("bad name", {"name": "-nope!", "budget": {"n_trials": 3}}, "name"),
    ("zero trials", spec(n_trials=0), "budget.n_trials"),
    ("negative trials", spec(n_trials=-4), "budget.n_trials"),
    ("string trials", {"name": "t", "budget": {"n_trials": "ten"}}, "budget.n_trials"),
    ("zero parallelism", spec(parallelism=0), "parallelism"),
    ("unknown top-level", spec(colour="red"), "colour"),
    ("unknown model field", spec(base={"model": {"n_layer": 3}}), "base.model.n_layer"),
    ("bad sampler", spec(sampler={"kind": "bogus"}), "sampler.kind"),
    ("bad pruner", spec(pruner={"kind": "sometimes"}), "pruner.kind"),
    ("bad objective metric", spec(objectives=[{"metric": "accuracy"}]), "objectives.0.metric"),
    ("bad direction", spec(objectives=[{"direction": "up"}]), "objectives.0.direction"),
    (
        "constraint with both",
        spec(
            constraints=[
                {"metric": "min_norm_entropy", "op": ">=", "value": 0.1, "fraction_of_steps": 0.2}
            ]
        ),
        "constraints.0",
    ),
    ("negative gpus", spec(resources={"gpus": -1}), "resources.gpus"),
    (
        "heads do not divide width",
        spec(base={"model": {"d_model": 64, "n_heads": 3}}),
        "base.model",
    ),
    ("bad task kind", spec(base={"task": {"kind": "chess"}}), "base.task.kind"),
]


@pytest.mark.parametrize(("label", "body", "field"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_invalid_spec_is_422_naming_the_field_and_writes_nothing(
    client: TestClient, engine: Engine, label: str, body: dict[str, Any], field: str
) -> None:
    before = n_studies(engine)
    r = post(client, body)
    err = assert_error_shape(r, 422, "validation_error")
    assert field in fields(r), (label, err)
    assert n_studies(engine) == before


# Errors raised by the spec's cross-field checks (and the discriminated search-space union)
# should carry the user's field path, as service/spec/__init__.py promises ("every error carries the
# dotted path of the field") and service/api/errors.py's comment says ("Drop pydantic's
# union-tag segments (e.g. 'float')"). Today they come back as "body" or with a ".float" tag.
FIELD_PATH_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "unknown search-space path",
        spec(search_space={"model.nope": {"type": "fixed", "value": 1}}),
        "search_space.model.nope",
    ),
    (
        "low >= high",
        spec(search_space={"optim.lr": {"type": "float", "low": 0.1, "high": 0.01}}),
        "search_space.optim.lr",
    ),
    (
        "empty choices",
        spec(search_space={"model.norm": {"type": "categorical", "choices": []}}),
        "search_space.model.norm.choices",
    ),
    (
        "pruner with two objectives",
        spec(
            pruner={"kind": "median"},
            objectives=[
                {"metric": "final_val_loss"},
                {"metric": "min_norm_entropy", "direction": "maximize"},
            ],
        ),
        "pruner.kind",
    ),
]


def test_cross_field_errors_name_the_users_field_path(client: TestClient, engine: Engine) -> None:
    before = n_studies(engine)
    got = {}
    for label, body, _ in FIELD_PATH_CASES:
        r = post(client, body)
        assert_error_shape(r, 422, "validation_error")
        got[label] = fields(r)
    assert n_studies(engine) == before
    assert got == {label: [f] for label, _, f in FIELD_PATH_CASES}


def test_oversized_body_is_413(mod_db: str, home: Path, engine: Engine) -> None:
    app = create_app(settings(mod_db, home, max_body_bytes=400), reconcile_loop=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        before = n_studies(engine)
        small = json.dumps({"name": "small", "budget": {"n_trials": 1}}).encode()
        assert len(small) < 400
        assert c.post("/v1/studies", content=small).status_code == 201
        big = json.dumps(spec("big", description="x" * 1000)).encode()
        assert_error_shape(c.post("/v1/studies", content=big), 413, "payload_too_large")
        big_yaml = (YAML_SPEC + "# " + "y" * 1000 + "\n").encode()
        r = c.post("/v1/studies", content=big_yaml, headers={"content-type": "application/yaml"})
        assert_error_shape(r, 413, "payload_too_large")
        assert n_studies(engine) == before + 1


@pytest.mark.parametrize(
    "ctype",
    [
        "application/xml",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "image/png",
    ],
)
def test_unsupported_content_type_is_415(client: TestClient, engine: Engine, ctype: str) -> None:
    before = n_studies(engine)
    assert_error_shape(post(client, spec(), ctype), 415, "unsupported_media_type")
    assert n_studies(engine) == before


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (b"name: [unclosed\nbudget: {n_trials: 1}\n", "application/yaml"),
        (b"name: t\n  budget: : :\n", "application/yaml"),
        (b'{"name": "t", "budget": ', "application/json"),
        (b"{'name': 't'}", "application/json"),
        (b"", "application/json"),
        (b"\xff\xfe\x00n\x00a", "application/yaml"),
    ],
)
def test_unparseable_body_is_400(
    client: TestClient, engine: Engine, body: bytes, ctype: str
) -> None:
    before = n_studies(engine)
    err = assert_error_shape(post(client, body, ctype), 400, "parse_error")
    assert [e["field"] for e in err["errors"]] == ["body"]
    assert n_studies(engine) == before


def test_deployment_limits_are_422_naming_the_field(
    mod_db: str, home: Path, engine: Engine
) -> None:
    app = create_app(settings(mod_db, home, max_trials=3, max_steps=500), reconcile_loop=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        before = n_studies(engine)
        r = post(c, spec(n_trials=4))
        assert_error_shape(r, 422, "limit_exceeded")
        assert fields(r) == ["budget.n_trials"]
        r = post(c, spec(n_trials=4, base={"steps": 501}))
        assert sorted(fields(r)) == ["base.steps", "budget.n_trials"]
        steps_space = {**SPACE, "steps": {"type": "int", "low": 100, "high": 600}}
        r = post(c, spec(n_trials=3, search_space=steps_space))
        assert_error_shape(r, 422, "limit_exceeded")
        assert fields(r) == ["base.steps"]
        assert n_studies(engine) == before
        assert post(c, spec(n_trials=3, base={"steps": 500})).status_code == 201
        assert n_studies(engine) == before + 1


# --- GET /v1/studies, GET /v1/studies/{id}, cancel --------------------------------------------


def test_list_studies_pages_in_id_order_with_totals(client: TestClient, engine: Engine) -> None:
    for i in range(5):
        create(client, spec(f"page-{i}"))
    with Session(engine) as s:
        ids = list(s.scalars(select(Study.id).order_by(Study.id.desc())))
    full = client.get("/v1/studies", params={"limit": 500}).json()
    assert full["total"] == len(ids) and [x["id"] for x in full["items"]] == ids
    assert full["limit"] == 500 and full["offset"] == 0
    assert client.get("/v1/studies").json()["limit"] == 50

    seen: list[int] = []
    offset = 0
    while True:
        page = client.get("/v1/studies", params={"limit": 3, "offset": offset}).json()
        assert page["total"] == len(ids) and page["limit"] == 3 and page["offset"] == offset
        assert len(page["items"]) == min(3, max(0, len(ids) - offset))
        if not page["items"]:
            break
        seen += [x["id"] for x in page["items"]]
        offset += 3
    assert seen == ids
    beyond = client.get("/v1/studies", params={"offset": len(ids) + 10}).json()
    assert beyond["items"] == [] and beyond["total"] == len(ids)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
        ({"offset": -1}, "offset"),
        ({"limit": "ten"}, "limit"),
        ({"status": "x" * 17}, "status"),
    ],
)
def test_list_studies_rejects_bad_paging(
    client: TestClient, params: dict[str, Any], field: str
) -> None:
    r = client.get("/v1/studies", params=params)
    assert_error_shape(r, 422, "validation_error")
    assert fields(r) == [field]


def test_list_studies_filters_by_status(client: TestClient, engine: Engine) -> None:
    sid = create(client, spec("to-cancel"))["id"]
    assert client.post(f"/v1/studies/{sid}/cancel").status_code == 200
    for status in ("CANCELLED", "cancelled", "PENDING"):
        page = client.get("/v1/studies", params={"status": status, "limit": 500}).json()
        expected = n_studies(engine, status=status.upper())
        assert page["total"] == expected == len(page["items"]) and expected > 0
        assert {x["status"] for x in page["items"]} == {status.upper()}
    assert sid in [
        x["id"] for x in client.get("/v1/studies?status=CANCELLED&limit=500").json()["items"]
    ]
    assert client.get("/v1/studies", params={"status": "RUNNING"}).json() == {
        "items": [],
        "total": 0,
        "limit": 50,
        "offset": 0,
    }


def test_get_study_and_404(client: TestClient) -> None:
    made = create(client, spec("get-me"))
    r = client.get(f"/v1/studies/{made['id']}")
    assert r.status_code == 200 and r.json() == made
    err = assert_error_shape(client.get("/v1/studies/987654"), 404, "not_found")
    assert "987654" in err["message"]
    assert_error_shape(client.get("/v1/studies/abc"), 422, "validation_error")


def test_cancel_pending_study_and_its_running_trials(client: TestClient, engine: Engine) -> None:
    sid = create(client, spec("cancel-me"))["id"]
    with Session(engine) as s:
        s.add_all(
            [
                Trial(study_id=sid, number=0, state="RUNNING", params={}),
                Trial(study_id=sid, number=1, state="COMPLETE", params={}, value=1.0),
            ]
        )
        s.commit()
    r = client.post(f"/v1/studies/{sid}/cancel")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "CANCELLED" and out["finished_at"] is not None
    assert client.get(f"/v1/studies/{sid}").json()["status"] == "CANCELLED"
    with Session(engine) as s:
        states = dict(
            s.execute(select(Trial.number, Trial.state).where(Trial.study_id == sid)).all()
        )
        errors = dict(
            s.execute(select(Trial.number, Trial.error).where(Trial.study_id == sid)).all()
        )
    assert states == {0: "CANCELLED", 1: "COMPLETE"} and errors[0] == "study cancelled"
    again = client.post(f"/v1/studies/{sid}/cancel")
    assert again.status_code == 200 and again.json() == out  # nothing changes the second time
    assert_error_shape(client.post("/v1/studies/987654/cancel"), 404, "not_found")


def test_cancel_leaves_a_finished_study_alone(client: TestClient, engine: Engine) -> None:
    sid = create(client, spec("finished"))["id"]
    with Session(engine) as s:
        row = s.get(Study, sid)
        assert row is not None
        row.status = "COMPLETED"
        s.commit()
    r = client.post(f"/v1/studies/{sid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "COMPLETED"
    assert r.json()["finished_at"] is None


# --- seeded trials and metrics ------------------------------------------------------------

# number, state, params, value, final_val_loss, min_norm_entropy, entropy/rank collapse, trapped,
# feasible. Trial 4 is COMPLETE with the lowest value but infeasible; trial 5 never sampled lambda.
TRIALS: list[tuple[Any, ...]] = [
    (0, "COMPLETE", 0.5, "pre", 2.10, 2.10, 0.35, False, False, False, True),
    (1, "COMPLETE", 0.002, "post", 1.70, 1.70, 0.05, True, False, True, True),
    (2, "PRUNED", 0.03, "pre", None, 2.90, 0.20, False, True, False, None),
    (3, "DIVERGED", 0.9, "pre", None, None, 0.01, True, True, False, None),
    (4, "COMPLETE", 0.0005, "post", 1.20, 1.20, 0.12, False, False, False, False),
    (5, "FAILED", None, "pre", None, None, None, None, None, None, None),
    (6, "RUNNING", 0.007, "post", None, None, None, None, None, None, None),
    (7, "COMPLETE", 0.25, "pre", 1.50, 1.50, 0.30, False, False, False, True),
    (8, "PRUNED", 0.0001, "post", None, 3.30, 0.08, True, False, True, None),
    (9, "COMPLETE", 0.04, "pre", 1.90, 1.90, 0.25, False, True, False, True),
    (10, "COMPLETE", 0.009, "post", 1.65, 1.65, 0.09, True, False, False, True),
    (11, "RUNNING", 0.6, "pre", None, None, None, None, None, None, None),
]
KEYS = (
    "number",
    "state",
    "lam",
    "norm",
    "value",
    "final_val_loss",
    "min_norm_entropy",
    "entropy_collapse",
    "rank_collapse",
    "trapped",
    "feasible",
)
N_TRIALS_BUDGET = 20


def metric_rows() -> list[tuple[str, int, int, int, float | None]]:
    rows: list[tuple[str, int, int, int, float | None]] = []
    for step in (0, 50, 100, 150):
        rows.append(("val_loss", -1, -1, step, 3.0 - step / 100))
        rows.append(("train_loss", -1, -1, step, None if step == 100 else 3.1 - step / 100))
        for layer in (0, 1):
            rows.append(("rank_ratio", layer, -1, step, 0.5 + layer / 10 - step / 1000))
            for head in (0, 1):
                rows.append(
                    ("attn_entropy_norm", layer, head, step, 0.9 - (layer + head) * step / 1000)
                )
    return rows


@pytest.fixture(scope="module")
def seeded(client: TestClient, engine: Engine) -> dict[str, Any]:
    study = create(client, spec("seeded", n_trials=N_TRIALS_BUDGET))
    sid = study["id"]
    data = [dict(zip(KEYS, t, strict=True)) for t in TRIALS]
    with Session(engine) as s:
        for d in data:
            params: dict[str, Any] = {"model.norm": d["norm"]}
            if d["lam"] is not None:
                params["regularizer.lambda"] = d["lam"]
            s.add(
                Trial(
                    study_id=sid,
                    number=d["number"],
                    state=d["state"],
                    params=params,
                    seed=1000 + d["number"],
                    value=d["value"],
                    values=None if d["value"] is None else [d["value"]],
                    feasible=d["feasible"],
                    final_val_loss=d["final_val_loss"],
                    min_norm_entropy=d["min_norm_entropy"],
                    entropy_collapse=d["entropy_collapse"],
                    rank_collapse=d["rank_collapse"],
                    trapped=d["trapped"],
                    last_step=150,
                    summary={"status": "completed", "steps_done": 150} if d["value"] else None,
                    duration_s=10.0 + d["number"],
                )
            )
        s.commit()
        ids = dict(s.execute(select(Trial.number, Trial.id).where(Trial.study_id == sid)).all())
        for number in (0, 1):
            s.add_all(
                Metric(trial_id=ids[number], name=n, layer=la, head=h, step=st, value=v)
                for n, la, h, st, v in metric_rows()
            )
        s.commit()
    for d in data:
        d["id"] = ids[d["number"]]
    return {"study_id": sid, "trials": data, "ids": ids}


def numbers(page: dict[str, Any]) -> list[int]:
    return [t["number"] for t in page["items"]]


def trials_of(client: TestClient, sid: int, params: Any = None) -> dict[str, Any]:
    r = client.get(f"/v1/studies/{sid}/trials", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


def nulls_last(key: str, desc: bool = False) -> Any:
    def k(d: dict[str, Any]) -> tuple[bool, float, int]:
        v = d[key]
        return (v is None, 0.0 if v is None else (-v if desc else v), d["number"])

    return k


def test_trials_default_listing(client: TestClient, seeded: dict[str, Any]) -> None:
    page = trials_of(client, seeded["study_id"])
    assert page["total"] == len(TRIALS) and page["limit"] == 50 and page["offset"] == 0
    assert numbers(page) == list(range(len(TRIALS)))
    first = page["items"][0]
    assert first["params"] == {"model.norm": "pre", "regularizer.lambda": 0.5}
    assert first["summary"] is None  # lists leave the summary out; GET /v1/trials/{id} has it
    assert first["values"] == [2.1] and first["feasible"] is True and first["seed"] == 1000
    by_number = {t["number"]: t for t in page["items"]}
    for d in seeded["trials"]:
        got = by_number[d["number"]]
        assert got["id"] == d["id"] and got["state"] == d["state"]
        for k in ("value", "final_val_loss", "min_norm_entropy", "entropy_collapse", "feasible"):
            assert got[k] == d[k], (d["number"], k)


@pytest.mark.parametrize(
    ("query", "predicate"),
    [
        (
            [("state", "COMPLETE"), ("state", "PRUNED")],
            lambda d: d["state"] in ("COMPLETE", "PRUNED"),
        ),
        ([("state", "RUNNING")], lambda d: d["state"] == "RUNNING"),
        (
            [("where", "min_norm_entropy>=0.1")],
            lambda d: d["min_norm_entropy"] is not None and d["min_norm_entropy"] >= 0.1,
        ),
        (
            [("where", "params.regularizer.lambda<0.01")],
            lambda d: d["lam"] is not None and d["lam"] < 0.01,
        ),
        (
            [("where", "params.regularizer.lambda >= 0.03"), ("where", "final_val_loss<2")],
            lambda d: (
                d["lam"] is not None
                and d["lam"] >= 0.03
                and d["final_val_loss"] is not None
                and d["final_val_loss"] < 2
            ),
        ),
        (
            [("state", "COMPLETE"), ("where", "value<=1.65")],
            lambda d: d["state"] == "COMPLETE" and d["value"] <= 1.65,
        ),
        ([("where", "number=3")], lambda d: d["number"] == 3),
        ([("where", "value>100")], lambda d: False),
    ],
)
def test_trial_filters_match_python(
    client: TestClient, seeded: dict[str, Any], query: list[tuple[str, str]], predicate: Any
) -> None:
    page = trials_of(client, seeded["study_id"], query)
    expected = [d["number"] for d in seeded["trials"] if predicate(d)]
    assert numbers(page) == expected and page["total"] == len(expected)


@pytest.mark.parametrize(
    ("sort", "key"),
    [
        ("-final_val_loss", nulls_last("final_val_loss", desc=True)),
        ("final_val_loss", nulls_last("final_val_loss")),
        ("min_norm_entropy", nulls_last("min_norm_entropy")),
        ("-value", nulls_last("value", desc=True)),
        ("params.regularizer.lambda", nulls_last("lam")),
        ("-params.regularizer.lambda", nulls_last("lam", desc=True)),
        ("-number", lambda d: -d["number"]),
    ],
)
def test_trial_sorting_matches_python_with_nulls_last(
    client: TestClient, seeded: dict[str, Any], sort: str, key: Any
) -> None:
    expected = [d["number"] for d in sorted(seeded["trials"], key=key)]
    assert numbers(trials_of(client, seeded["study_id"], {"sort": sort})) == expected
    # Paging through the same order gives the same sequence, with the full total on each page.
    got: list[int] = []
    for offset in range(0, len(expected), 5):
        page = trials_of(client, seeded["study_id"], {"sort": sort, "limit": 5, "offset": offset})
        assert page["total"] == len(expected) and page["offset"] == offset
        got += numbers(page)
    assert got == expected


def test_trial_sort_and_filter_combined(client: TestClient, seeded: dict[str, Any]) -> None:
    q = [
        ("state", "COMPLETE"),
        ("where", "min_norm_entropy>=0.1"),
        ("sort", "-params.regularizer.lambda"),
        ("limit", "2"),
        ("offset", "1"),
    ]
    rows = [
        d for d in seeded["trials"] if d["state"] == "COMPLETE" and d["min_norm_entropy"] >= 0.1
    ]
    expected = [d["number"] for d in sorted(rows, key=nulls_last("lam", desc=True))]
    page = trials_of(client, seeded["study_id"], q)
    assert page["total"] == len(rows) and numbers(page) == expected[1:3]


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"where": "params.model.norm=1"}, "where"),  # categorical: not comparable
        ({"where": "params.model.nope<1"}, "where"),  # not in the search space
        ({"where": "min_norm_entropy >>= 0.1"}, "where"),
        ({"where": "garbage"}, "where"),
        ({"where": "colour<1"}, "where"),
        ({"where": "value<abc"}, "where"),
        ({"where": "value<0.1; DROP TABLE qk_trial"}, "where"),
        ({"sort": "colour"}, "sort"),
        ({"sort": "-"}, "sort"),
        ({"state": "SLEEPING"}, "state.0"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"offset": -1}, "offset"),
    ],
)
def test_trial_query_errors_are_422_naming_the_parameter(
    client: TestClient, seeded: dict[str, Any], query: dict[str, Any], field: str
) -> None:
    r = client.get(f"/v1/studies/{seeded['study_id']}/trials", params=query)
    assert_error_shape(r, 422, "validation_error")
    assert fields(r) == [field], r.json()
    assert trials_of(client, seeded["study_id"])["total"] == len(TRIALS)  # table intact


def test_bad_param_sort_names_the_sort_parameter(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    r = client.get(f"/v1/studies/{seeded['study_id']}/trials", params={"sort": "params.model.norm"})
    assert_error_shape(r, 422, "validation_error")
    assert fields(r) == ["sort"]


def test_trials_of_missing_study_is_404(client: TestClient) -> None:
    assert_error_shape(client.get("/v1/studies/987654/trials"), 404, "not_found")


def test_get_trial_includes_its_summary(client: TestClient, seeded: dict[str, Any]) -> None:
    d = seeded["trials"][7]
    r = client.get(f"/v1/trials/{d['id']}")
    assert r.status_code == 200, r.text
    t = r.json()
    assert t["id"] == d["id"] and t["study_id"] == seeded["study_id"] and t["number"] == 7
    assert t["state"] == "COMPLETE" and t["value"] == 1.5 and t["values"] == [1.5]
    assert t["params"] == {"model.norm": "pre", "regularizer.lambda": 0.25}
    assert t["summary"] == {"status": "completed", "steps_done": 150}
    assert t["duration_s"] == 17.0 and t["last_step"] == 150
    assert_error_shape(client.get("/v1/trials/987654"), 404, "not_found")


def _expected_metrics(**f: Any) -> list[dict[str, Any]]:
    rows = sorted(metric_rows(), key=lambda r: (r[0], r[1], r[2], r[3]))
    out = []
    for name, layer, head, step, value in rows:
        if f.get("name") and name not in f["name"]:
            continue
        if f.get("layer") is not None and layer != f["layer"]:
            continue
        if f.get("head") is not None and head != f["head"]:
            continue
        if f.get("step_min") is not None and step < f["step_min"]:
            continue
        if f.get("step_max") is not None and step > f["step_max"]:
            continue
        out.append(
            {
                "name": name,
                "layer": None if layer == -1 else layer,
                "head": None if head == -1 else head,
                "step": step,
                "value": value,
            }
        )
    return out


@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"name": ["val_loss"]},
        {"name": ["val_loss", "rank_ratio"]},
        {"name": ["qk_eig_var"]},  # a known metric this trial has no rows of: empty
        {"layer": 1},
        {"layer": 1, "head": 0},
        {"head": 1},
        {"step_min": 50, "step_max": 100},
        {"name": ["attn_entropy_norm"], "layer": 0, "head": 1, "step_min": 100},
    ],
)
def test_metrics_filters_and_null_indices(
    client: TestClient, seeded: dict[str, Any], filters: dict[str, Any]
) -> None:
    tid = seeded["ids"][1]
    r = client.get(f"/v1/trials/{tid}/metrics", params=filters)
    assert r.status_code == 200, r.text
    got = r.json()
    for m in got:
        if m["value"] is not None:
            m["value"] = pytest.approx(m["value"])
    assert got == _expected_metrics(**filters)
    scalars = [m for m in got if m["name"] in ("val_loss", "train_loss")]
    assert all(m["layer"] is None and m["head"] is None for m in scalars)


def test_metrics_limit_errors_and_404(client: TestClient, seeded: dict[str, Any]) -> None:
    tid = seeded["ids"][0]
    r = client.get(f"/v1/trials/{tid}/metrics", params={"limit": 3})
    assert [(m["name"], m["step"]) for m in r.json()] == [
        (m["name"], m["step"]) for m in _expected_metrics()[:3]
    ]
    assert (
        client.get(f"/v1/trials/{seeded['ids'][7]}/metrics").json() == []
    )  # trial without metrics
    for bad in ({"layer": -1}, {"head": -1}, {"step_min": -5}, {"limit": 0}):
        assert_error_shape(
            client.get(f"/v1/trials/{tid}/metrics", params=bad), 422, "validation_error"
        )
    assert_error_shape(client.get("/v1/trials/987654/metrics"), 404, "not_found")


def test_summary_matches_independent_sql_and_python(
    client: TestClient, engine: Engine, seeded: dict[str, Any]
) -> None:
    sid = seeded["study_id"]
    r = client.get(f"/v1/studies/{sid}/summary")
    assert r.status_code == 200, r.text
    got = r.json()
    with engine.connect() as conn:
        counts = dict(
            conn.execute(
                text("SELECT state, COUNT(*) FROM qk_trial WHERE study_id = :sid GROUP BY state"),
                {"sid": sid},
            ).all()
        )
    states = ("QUEUED", "RUNNING", "COMPLETE", "PRUNED", "DIVERGED", "FAILED", "CANCELLED")
    assert got["trials_by_state"] == {s: int(counts.get(s, 0)) for s in states}
    assert sum(got["trials_by_state"].values()) == len(TRIALS)
    finished = len(TRIALS) - counts.get("RUNNING", 0) - counts.get("QUEUED", 0)
    assert got["finished"] == finished
    assert got["progress"] == pytest.approx(finished / N_TRIALS_BUDGET)
    measured = [d for d in seeded["trials"] if d["state"] in ("COMPLETE", "PRUNED", "DIVERGED")]
    for flag in ("entropy_collapse", "rank_collapse", "trapped"):
        rate = sum(1 for d in measured if d[flag]) / len(measured)
        assert got[f"{flag}_rate"] == pytest.approx(rate), flag
    assert (
        got["study_id"] == sid and got["status"] == "PENDING" and got["n_trials"] == N_TRIALS_BUDGET
    )
    assert got["eta_s"] is None  # only a RUNNING study has an ETA
    complete = [
        d for d in seeded["trials"] if d["state"] == "COMPLETE" and d["feasible"] is not False
    ]
    assert got["best_value"] == min(d["value"] for d in complete)  # same "best" as /best


def test_summary_best_agrees_with_best_endpoint(client: TestClient, seeded: dict[str, Any]) -> None:
    sid = seeded["study_id"]
    summary = client.get(f"/v1/studies/{sid}/summary").json()
    best = client.get(f"/v1/studies/{sid}/best").json()
    assert summary["best_trial_id"] == best[0]["id"] and summary["best_value"] == best[0]["value"]


def test_summary_of_empty_study_and_404(client: TestClient) -> None:
    sid = create(client, spec("empty"))["id"]
    got = client.get(f"/v1/studies/{sid}/summary").json()
    assert got["trials_by_state"] == dict.fromkeys(
        ("QUEUED", "RUNNING", "COMPLETE", "PRUNED", "DIVERGED", "FAILED", "CANCELLED"), 0
    )
    assert got["finished"] == 0 and got["progress"] == 0.0 and got["best_value"] is None
    assert got["entropy_collapse_rate"] is None and got["best_trial_id"] is None
    assert_error_shape(client.get("/v1/studies/987654/summary"), 404, "not_found")


def test_best_single_objective_is_min_feasible_complete(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    sid = seeded["study_id"]
    r = client.get(f"/v1/studies/{sid}/best")
    assert r.status_code == 200, r.text
    complete = [d for d in seeded["trials"] if d["state"] == "COMPLETE"]
    feasible = [d for d in complete if d["feasible"] is not False]
    best = min(feasible, key=lambda d: d["value"])
    assert [t["id"] for t in r.json()] == [best["id"]] and best["number"] == 7
    assert r.json()[0]["summary"] == {"status": "completed", "steps_done": 150}
    anyf = client.get(f"/v1/studies/{sid}/best", params={"feasible_only": "false"}).json()
    assert [t["id"] for t in anyf] == [min(complete, key=lambda d: d["value"])["id"]]
    assert client.get(f"/v1/studies/{create(client, spec('no-trials'))['id']}/best").json() == []
    assert_error_shape(client.get("/v1/studies/987654/best"), 404, "not_found")


def _pareto(points: dict[int, tuple[float, float]]) -> set[int]:
    """Brute force: minimise the first value, maximise the second."""

    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] <= b[0] and a[1] >= b[1] and a != b

    return {i for i, p in points.items() if not any(dominates(q, p) for q in points.values())}


def test_best_two_objectives_is_the_brute_force_pareto_front(
    client: TestClient, engine: Engine
) -> None:
    import random

    body = spec(
        "pareto",
        n_trials=60,
        objectives=[
            {"metric": "final_val_loss", "direction": "minimize"},
            {"metric": "min_norm_entropy", "direction": "maximize"},
        ],
    )
    sid = create(client, body)["id"]
    rng = random.Random(1234)
    rows: list[dict[str, Any]] = []
    for n in range(40):
        # A coarse grid makes ties and weak dominance common.
        fvl, mne = rng.choice([1.0, 1.5, 2.0, 2.5, 3.0]), rng.choice([0.1, 0.2, 0.3, 0.4, 0.5])
        state = "COMPLETE" if n < 30 else rng.choice(["PRUNED", "FAILED", "RUNNING", "DIVERGED"])
        feasible = None if n % 7 else (n % 2 == 0)
        values: list[float | None] | None = [fvl, mne]
        if n == 29:
            values = [0.1, None]  # an incomplete vector is never on the front
        rows.append({"number": n, "state": state, "values": values, "feasible": feasible})
    rows.append({"number": 40, "state": "PRUNED", "values": [0.0, 9.0], "feasible": True})
    rows.append({"number": 41, "state": "COMPLETE", "values": [0.0, 9.0], "feasible": False})
    with Session(engine) as s:
        for d in rows:
            v = d["values"]
            s.add(
                Trial(
                    study_id=sid,
                    number=d["number"],
                    state=d["state"],
                    params={},
                    values=v,
                    value=None if v is None else v[0],
                    feasible=d["feasible"],
                    final_val_loss=None if v is None else v[0],
                    min_norm_entropy=None if v is None else v[1],
                )
            )
        s.commit()
        ids = dict(s.execute(select(Trial.number, Trial.id).where(Trial.study_id == sid)).all())

    def front(feasible_only: bool) -> set[int]:
        cands = {
            ids[d["number"]]: (d["values"][0], d["values"][1])
            for d in rows
            if d["state"] == "COMPLETE"
            and None not in d["values"]
            and (not feasible_only or d["feasible"] is not False)
        }
        return _pareto(cands)

    for feasible_only in (True, False):
        got = client.get(f"/v1/studies/{sid}/best", params={"feasible_only": feasible_only}).json()
        expected = front(feasible_only)
        assert {t["id"] for t in got} == expected and len(got) == len(expected)
        keys = [(t["values"][0], -t["values"][1]) for t in got]
        assert keys == sorted(keys)
        assert all(t["state"] == "COMPLETE" for t in got)
    assert ids[41] not in front(True) and front(False) == {ids[41]}


# --- schema, health, docs ---------------------------------------------------------------------


def test_spec_schema_is_the_study_spec_json_schema(client: TestClient) -> None:
    r = client.get("/v1/spec-schema")
    assert r.status_code == 200
    schema = r.json()
    assert schema == json.loads(json.dumps(StudySpec.model_json_schema(by_alias=True)))
    assert {"name", "budget", "search_space", "objectives"} <= set(schema["properties"])
    assert "budget" in schema["required"] and "name" in schema["required"]


def test_healthz_docs_and_openapi(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["database"] in ("up", "unknown")  # unknown: before the first probe
    docs = client.get("/docs")
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    assert "openapi.json" in docs.text
    api = client.get("/openapi.json")
    assert api.status_code == 200
    paths = api.json()["paths"]
    expected = {
        "/healthz": {"get"},
        "/v1/spec-schema": {"get"},
        "/v1/studies": {"get", "post"},
        "/v1/studies/{study_id}": {"get"},
        "/v1/studies/{study_id}/cancel": {"post"},
        "/v1/studies/{study_id}/trials": {"get"},
        "/v1/studies/{study_id}/summary": {"get"},
        "/v1/studies/{study_id}/best": {"get"},
        "/v1/trials/{trial_id}": {"get"},
        "/v1/trials/{trial_id}/metrics": {"get"},
    }
    assert all(set(paths.get(p, {})) >= ops for p, ops in expected.items()), sorted(paths)
    content = paths["/v1/studies"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/yaml"} <= set(content)


def test_every_openapi_ref_resolves(client: TestClient) -> None:
    api = client.get("/openapi.json").json()
    refs = set(re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', json.dumps(api)))
    assert refs <= set(api["components"]["schemas"]), refs - set(api["components"]["schemas"])


# --- found bugs: out-of-range numbers in paths and queries ----------------------------------


def test_out_of_range_ids_and_offsets_are_client_errors(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    tid = seeded["ids"][0]
    sid = seeded["study_id"]
    for big in (2**31, 2**63, 10**30):
        for path in (
            f"/v1/studies/{big}",
            f"/v1/studies/{big}/trials",
            f"/v1/studies/{big}/summary",
            f"/v1/studies/{big}/best",
            f"/v1/trials/{big}",
            f"/v1/trials/{big}/metrics",
        ):
            assert client.get(path).status_code in (404, 422), path
        assert client.post(f"/v1/studies/{big}/cancel").status_code in (404, 422)
        assert client.get("/v1/studies", params={"offset": big}).status_code in (200, 422)
        r = client.get(f"/v1/studies/{sid}/trials", params={"offset": big})
        assert r.status_code in (200, 422)
        r = client.get(f"/v1/trials/{tid}/metrics", params={"layer": big, "step_min": big})
        assert r.status_code in (200, 422)


def test_nul_bytes_in_query_strings_are_client_errors(
    request: pytest.FixtureRequest, client: TestClient, mod_db: str, seeded: dict[str, Any]
) -> None:
    r = client.get("/v1/studies", params={"status": "PEN\x00DING"})
    assert r.status_code in (200, 422), r.text
    r = client.get(f"/v1/trials/{seeded['ids'][0]}/metrics", params={"name": "val\x00loss"})
    assert r.status_code in (200, 422), r.text
