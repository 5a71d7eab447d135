"""Issue 42, item 4 and the live cap: no small POST exhausts the head.

- the worst points of the memory check are the distinct valid values of the choosing fields,
  never the product of the choices as written (1,000 copies of one choice in three fields
  asked for 1e9 points and held the API for 25 s), and a repeated choice is a 422;
- every integer of a definition is bounded: a 400-digit integer is a 422 naming its field,
  not a 500 (`OverflowError` in the limits);
- a searched `dtype: float64` is a worst point (8 bytes a number);
- live studies are capped (QKSCOPE_MAX_LIVE_STUDIES, QKSCOPE_HEAD_MEMORY_BYTES): a POST past
  the cap is a 429 with Retry-After and writes nothing, also when POSTs race.

Each POST runs against SQLite and PostgreSQL (the app has no Ray: studies stay PENDING).
"""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from service.app import create_app
from service.config import Settings
from service.spec import StudySpec
from service.spec.space import CHOOSING, worst_points
from service.store import Store, StudyStatus, make_sessionmaker
from service.store.session import make_engine
from tests.service.conftest import live_api
from tests.service.helpers import VALID, check_rejected, n_studies, names_field, post

HUGE = 10**400


@pytest.fixture(scope="module")
def client(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        database_url=module_db_url,
        ray_address="",
        api_tokens="",
        home=tmp_path_factory.mktemp("h"),
    )
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def engine(client: TestClient, module_db_url: str) -> Iterator[Engine]:
    eng = make_engine(module_db_url)
    yield eng
    eng.dispose()


def _with(over: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(VALID)
    for key, value in over.items():
        if key == "search_space":
            body["search_space"].update(value)
        else:
            body[key] = value
    return body


# ---- repeated choices ----------------------------------------------------------------------

# The review's body: one choice 1,000 times in each of three choosing fields.
REPEATED = _with(
    {
        "search_space": {
            "task.kind": {"type": "categorical", "choices": ["associative_recall"] * 1000},
            "model.mlp": {"type": "categorical", "choices": [True] * 1000},
            "model.block": {"type": "categorical", "choices": ["custom"] * 1000},
        }
    }
)

DUPLICATES: list[tuple[str, dict[str, Any], str]] = [
    ("the review's 1e9 points", REPEATED, "search_space.task.kind.choices"),
    (
        "a repeated string",
        _with({"search_space": {"model.norm": {"type": "categorical", "choices": ["pre", "pre"]}}}),
        "search_space.model.norm.choices",
    ),
    (
        "1 and 1.0 are one number",
        _with({"search_space": {"model.n_layers": {"type": "categorical", "choices": [1, 1.0]}}}),
        "search_space.model.n_layers.choices",
    ),
    (
        "a repeated grid value",
        _with(
            {
                "sampler": {"kind": "grid"},
                "search_space": {
                    "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "grid": [1e-3, 1e-3]},
                    "model.norm": {"type": "fixed", "value": "pre"},
                },
            }
        ),
        "search_space.optim.lr.grid",
    ),
]


@pytest.mark.parametrize(("label", "body", "field"), DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_a_repeated_choice_is_a_422_naming_it(
    client: TestClient, engine: Engine, label: str, body: dict[str, Any], field: str
) -> None:
    before = n_studies(engine)
    out = check_rejected(client, body, "application/json", label)
    assert out["status"] == 422, out
    assert names_field(out, field), out
    assert "repeats" in out["message"], out
    assert n_studies(engine) == before


def test_true_and_1_are_different_choices() -> None:
    """A boolean is not a number: [true, 1] is two choices (Optuna keeps them apart)."""
    spec = StudySpec.model_validate(
        _with({"search_space": {"eval_at_init": {"type": "categorical", "choices": [True, 1]}}})
    )
    assert spec.search_space["eval_at_init"].choices == [True, 1]  # type: ignore[union-attr]


def test_the_worst_points_are_the_distinct_valid_values_not_the_written_product() -> None:
    """Spellings of one value (pydantic reads "true", "yes", "on", 1 as True) are one value
    of the field: the points are the product of distinct values as the trial config reads
    them (3 x 2 x 3 x 2 here), not of the 14 x ... choices as written (before: 756)."""
    trues, falses = ["true", "yes", "on", "1", "t", "y", True], ["false", "no", "off", "0", False]
    body = _with(
        {
            "search_space": {
                "task.kind": {
                    "type": "categorical",
                    "choices": ["associative_recall", "copy", "sort"],
                },
                "model.mlp": {"type": "categorical", "choices": trues + falses},
                "model.block": {"type": "categorical", "choices": ["custom", "pure", "full"]},
                "dtype": {"type": "categorical", "choices": ["float32", "float64"]},
            }
        }
    )
    spec = StudySpec.model_validate(body)
    points = worst_points(spec)
    searched = ("task.kind", "model.mlp", "model.block", "dtype")
    assert set(searched) <= set(CHOOSING)
    combos = {tuple(params[p] for p in searched) for params, _ in points}
    want = set(
        itertools.product(
            ["associative_recall", "copy", "sort"],
            [True, False],
            ["custom", "pure", "full"],
            ["float32", "float64"],
        )
    )
    assert combos == want and len(points) == len(want) == 36
    for params, config in points:  # each config carries the values of its point
        assert config.task.kind == params["task.kind"] and config.dtype == params["dtype"]


def test_a_searched_float64_is_a_worst_point_and_named(client: TestClient, engine: Engine) -> None:
    """Before: the worst points ignored `dtype` and the estimate counted 4 bytes a number,
    so a model that fits only in float32 was accepted with float64 among its choices."""
    from workers.config import TrialConfig
    from workers.fusion_plan import memory_estimate

    base = {"model": {"n_layers": 2, "d_model": 1024, "d_ff": 4096, "n_heads": 8}, "batch_size": 8}
    body = _with({"base": base, "fuse": 1})
    body["search_space"]["dtype"] = {"type": "categorical", "choices": ["float32", "float64"]}
    f32 = memory_estimate(TrialConfig.model_validate({**base, "dtype": "float32"})).total
    f64 = memory_estimate(TrialConfig.model_validate({**base, "dtype": "float64"})).total
    assert f64 > 1.8 * f32
    limit = (f32 + f64) // 2  # fits in float32, not in float64
    settings = client.app.state.settings  # type: ignore[attr-defined]
    old = settings.max_trial_memory_bytes
    settings.max_trial_memory_bytes = limit
    try:
        before = n_studies(engine)
        out = check_rejected(client, body, "application/json")
        assert out["status"] == 422 and names_field(out, "search_space.dtype"), out
        assert "float64" in out["message"], out
        assert n_studies(engine) == before
        body["search_space"]["dtype"]["choices"] = ["float32", "bfloat16"]
        assert post(client, body, "application/json").status_code == 201
    finally:
        settings.max_trial_memory_bytes = old


# ---- integers of any size ----------------------------------------------------------------


def _huge_at(where: str) -> dict[str, Any]:
    body = copy.deepcopy(VALID)
    if where == "base.eval_every":
        body["base"] = {"eval_every": HUGE}
    elif where == "base.optim.warmup_steps":
        body["base"] = {"optim": {"warmup_steps": HUGE}}
    elif where == "base.checkpoint.every_evals":
        body["base"] = {"checkpoint": {"every_evals": HUGE}}
    elif where == "pruner.n_warmup_steps":
        body["pruner"] = {"kind": "median", "n_warmup_steps": HUGE}
    elif where == "budget.n_trials":
        body["budget"] = {"n_trials": HUGE}
    elif where == "search_space.steps.high":
        body["search_space"]["steps"] = {"type": "int", "low": 10, "high": HUGE}
    elif where == "search_space.eval_every.choices.1":
        body["search_space"]["eval_every"] = {"type": "categorical", "choices": [10, HUGE]}
    elif where == "search_space.eval_every.value":
        body["search_space"]["eval_every"] = {"type": "fixed", "value": HUGE}
    elif where == "search_space.eval_every.grid.0":
        body["sampler"] = {"kind": "grid"}
        body["search_space"] = {
            "eval_every": {"type": "int", "low": 1, "high": 100, "grid": [HUGE, 10]}
        }
    return body


HUGE_FIELDS = [
    "base.eval_every",
    "base.optim.warmup_steps",
    "base.checkpoint.every_evals",
    "pruner.n_warmup_steps",
    "budget.n_trials",
    "search_space.steps.high",
    "search_space.eval_every.choices.1",
    "search_space.eval_every.value",
    "search_space.eval_every.grid.0",
]


@pytest.mark.parametrize("field", HUGE_FIELDS)
@pytest.mark.parametrize("ctype", ["application/json", "application/yaml"])
def test_a_400_digit_integer_is_a_422_naming_its_field(
    client: TestClient, engine: Engine, field: str, ctype: str
) -> None:
    """Before: a 500 (OverflowError converting it to a float in the limits) for most of
    these, a 422 only where the field had a bound of its own. YAML reads the same integer."""
    body = _huge_at(field)
    content = json.dumps(body).encode()  # JSON is YAML: the YAML loader reads it too
    before = n_studies(engine)
    r = post(client, content, ctype)
    assert r.status_code == 422, (field, r.status_code, r.text[:300])
    out = r.json()
    assert names_field(out, field), out
    assert n_studies(engine) == before


def test_an_integer_given_as_digits_is_bounded_too(client: TestClient, engine: Engine) -> None:
    """pydantic reads a string of digits into an integer field: bounded after validation."""
    body = copy.deepcopy(VALID)
    body["base"] = {"eval_every": "9" * 400}
    before = n_studies(engine)
    out = check_rejected(client, body, "application/json")
    assert out["status"] == 422 and names_field(out, "base.eval_every"), out
    assert n_studies(engine) == before


def test_the_largest_safe_integer_is_still_read(client: TestClient) -> None:
    """The bound is 2**53: a field's own bound answers beyond it for bounded fields, and an
    integer at the bound is no error of this check (it is refused for being too many steps,
    by its own field)."""
    body = copy.deepcopy(VALID)
    body["base"] = {"eval_every": 2**53}
    r = post(client, body, "application/json")
    assert r.status_code == 201, r.text


# ---- the live cap --------------------------------------------------------------------------


def _capped(db_url: str, home: Path, **kw: Any) -> Settings:
    return Settings(database_url=db_url, ray_address="", api_tokens="", home=home, **kw)


def _spec(i: int) -> dict[str, Any]:
    return {**copy.deepcopy(VALID), "name": f"live-{i}"}


def test_a_post_past_the_live_cap_is_a_429_with_retry_after(db_url: str, tmp_path: Path) -> None:
    settings = _capped(db_url, tmp_path, max_live_studies=2)
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        engine = make_engine(db_url)
        try:
            keys = [{"Idempotency-Key": f"k{i}"} for i in range(3)]
            ids = [
                c.post("/v1/studies", json=_spec(i), headers=keys[i]).json()["id"] for i in (0, 1)
            ]
            r = c.post("/v1/studies", json=_spec(2), headers=keys[2])
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) > 0
            body = r.json()
            assert body["error"] == "too_many_live_studies"
            assert "QKSCOPE_MAX_LIVE_STUDIES" in body["message"] and "2 studies" in body["message"]
            assert n_studies(engine) == 2  # nothing written
            # A retry of a POST that made its study gets that study, cap or not.
            again = c.post("/v1/studies", json=_spec(0), headers=keys[0])
            assert again.status_code == 200 and again.json()["id"] == ids[0]
            # A study ends: the next POST is admitted.
            Store(make_sessionmaker(engine)).studies.set_status(ids[0], StudyStatus.CANCELLED)
            r = c.post("/v1/studies", json=_spec(2), headers=keys[2])
            assert r.status_code == 201, r.text
            assert n_studies(engine) == 3
        finally:
            engine.dispose()


def test_the_head_memory_bound_caps_live_studies_too(db_url: str, tmp_path: Path) -> None:
    settings = _capped(
        db_url,
        tmp_path,
        max_live_studies=50,
        head_memory_bytes=3 * 512 * 2**20 + 100,
        head_bytes_per_study=512 * 2**20,
    )
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        codes = [c.post("/v1/studies", json=_spec(i)).status_code for i in range(4)]
        assert codes == [201, 201, 201, 429]
        last = c.post("/v1/studies", json=_spec(9))
        assert "QKSCOPE_HEAD_MEMORY_BYTES" in last.json()["message"], last.text


def test_racing_posts_never_pass_the_cap(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twelve POSTs at once against a cap of 3 through a real server (uvicorn): exactly 3
    studies, the others 429; before the count and the insert were one step, all of them
    could read 'room for one more'."""
    settings = _capped(db_url, tmp_path, max_live_studies=3)
    with live_api(settings, monkeypatch) as base:

        def one(i: int) -> int:
            return httpx.post(f"{base}/v1/studies", json=_spec(i), timeout=120).status_code

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            codes = sorted(pool.map(one, range(12)))
    engine = make_engine(db_url)
    try:
        assert codes == [201] * 3 + [429] * 9, codes
        assert n_studies(engine) == 3
    finally:
        engine.dispose()
