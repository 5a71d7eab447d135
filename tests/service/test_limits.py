"""Issue 32, item 2: definitions that pass every field's own bounds and still exhaust the head,
a worker or the database. Each is POSTed: a 422 naming the field and the limit's setting,
and no row; with that setting raised, the same definition is accepted (the limit is the
setting, not a constant). The estimates are checked against independent counts."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from service.app import create_app
from service.config import Settings
from service.spec import StudySpec
from service.spec.limits import (
    evaluations,
    grid_points,
    metric_rows_per_evaluation,
    param_bytes_per_trial,
)
from service.store.session import make_engine
from tests.service.helpers import VALID, check_rejected, n_studies, names_field, post

ROOT = Path(__file__).resolve().parents[2]


def _grid(n: int, low: float, high: float) -> dict[str, Any]:
    return {
        "type": "float",
        "low": low,
        "high": high,
        "grid": [low + (high - low) * i / (n - 1) for i in range(n)],
    }


# Three 1000-value grids: Optuna's GridSampler would build 1e9 points (about 68 GiB).
GRID_1E9 = {
    **VALID,
    "sampler": {"kind": "grid"},
    "budget": {"n_trials": 10},
    "search_space": {
        "optim.lr": _grid(1000, 1e-4, 1e-2),
        "model.qk_init_std": _grid(1000, 0.01, 1.0),
        "regularizer.lambda": _grid(1000, 0.0, 1.0),
    },
}
# eval_every 1 over 1e6 steps: 1e6 evaluations, about 3.6e7 metric rows per trial.
EVERY_STEP = {**VALID, "base": {"steps": 1_000_000, "eval_every": 1}}
# 64 layers of 64 heads, evaluated at every one of 300 steps: ~1e7 rows per trial.
WIDE = {
    **VALID,
    "base": {"eval_every": 1, "model": {"n_layers": 64, "n_heads": 64, "d_model": 64}},
}
# The same model evaluated 7 times, 10,000 trials: ~2.3e9 rows for the study.
MANY = {
    **VALID,
    "budget": {"n_trials": 10_000},
    "base": {"model": {"n_layers": 64, "n_heads": 64, "d_model": 64}},
}
# A 134M-parameter model checkpointed at each of 1000 evaluations: ~1.6 TB written.
CHECKPOINTS = {
    **VALID,
    "base": {
        "steps": 1000,
        "eval_every": 1,
        "model": {"n_layers": 1, "d_model": 4096, "n_heads": 2, "d_ff": 8192},
    },
}
LM = {"kind": "lm", "data_dir": "c", "tokenizer": "char", "vocab_cap": 256}
# A 5000-character categorical choice: stored with every trial in Optuna's tables.
LONG_CHOICE = {
    **VALID,
    "base": {"task": LM},
    "search_space": {"task.valid_split": {"type": "categorical", "choices": ["valid", "v" * 5000]}},
}
LONG_BASE = {**VALID, "base": {"task": {**LM, "train_split": "t" * 2000}}}
# 1000 choices of 200 characters over 10,000 trials: each trial's parameter row in Optuna's
# tables holds all of them (about 2 GB).
WIDE_CHOICES = {
    **VALID,
    "budget": {"n_trials": 10_000},
    "base": {"task": LM},
    "search_space": {
        "task.valid_split": {"type": "categorical", "choices": [f"{i:0200d}" for i in range(1000)]}
    },
}

# (label, body, field named, the setting, a value of it that accepts the body; a hostile
# body may exceed several limits: each is named, and all of them are raised)
HOSTILE: list[tuple[str, dict[str, Any], str, str, int]] = [
    ("grid of 1e9 points", GRID_1E9, "search_space.optim.lr", "max_grid_points", 10**9),
    ("eval_every 1 over 1e6 steps", EVERY_STEP, "base.eval_every", "max_evals_per_trial", 10**6),
    ("64x64 heads every step", WIDE, "base.eval_every", "max_metric_rows_per_trial", 10**8),
    ("10,000 trials of 64x64 heads", MANY, "budget.n_trials", "max_metric_rows_per_study", 10**10),
    (
        "a huge model checkpointed every step",
        CHECKPOINTS,
        "base.checkpoint.every_evals",
        "max_checkpoint_bytes_per_trial",
        2**42,
    ),
    (
        "a 5000-character choice",
        LONG_CHOICE,
        "search_space.task.valid_split.choices.1",
        "max_string_chars",
        10_000,
    ),
    ("a 2000-character split name", LONG_BASE, "base.task.train_split", "max_string_chars", 10_000),
    (
        "1000 long choices over 10,000 trials",
        WIDE_CHOICES,
        "search_space.task.valid_split",
        "max_param_bytes_per_study",
        2**32,
    ),
]


@pytest.fixture(scope="module")
def settings(module_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("h")
    return Settings(database_url=module_db_url, ray_address="", api_tokens="", home=home)


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def engine(client: TestClient, module_db_url: str) -> Iterator[Engine]:
    eng = make_engine(module_db_url)
    yield eng
    eng.dispose()


@pytest.mark.parametrize(
    ("label", "body", "field", "setting", "raised"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_a_hostile_definition_is_a_422_naming_the_field_and_the_limit(
    client: TestClient,
    engine: Engine,
    settings: Settings,
    label: str,
    body: dict[str, Any],
    field: str,
    setting: str,
    raised: int,
) -> None:
    out = check_rejected(client, body, "application/json", label)
    assert out["status"] == 422 and out["error"] == "limit_exceeded", out
    assert names_field(out, field)
    env = f"QKSCOPE_{setting.upper()}"
    assert any(e["field"] == field and env in e["message"] for e in out["errors"]), out
    assert n_studies(engine) == 0
    # The limit is the setting: raised (with the others this body exceeds), it is stored.
    exceeded = {
        name: 10**15
        for name in Settings.model_fields
        if name.startswith("max_") and f"QKSCOPE_{name.upper()}" in out["message"]
    }
    more = settings.model_copy(update={**exceeded, setting: raised})
    with TestClient(create_app(more, reconcile_loop=False)) as c:
        r = post(c, body, "application/json")
    try:
        assert r.status_code == 201, r.text
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM qk_study"))


def test_the_estimates_match_independent_counts(tmp_path: Path) -> None:
    """The grid's size is the product Optuna builds; evaluations are the steps the engine
    evaluates (workers/engine.py: step % eval_every == 0 or the last step, plus step 0 with
    eval_at_init); rows per evaluation are what a real evaluation of the model reports."""
    import optuna

    small = copy.deepcopy(GRID_1E9)
    small["search_space"] = {
        "optim.lr": _grid(7, 1e-4, 1e-2),
        "model.qk_init_std": _grid(5, 0.01, 1.0),
        "model.norm": {"type": "categorical", "choices": ["pre", "post", "none"]},
    }
    spec = StudySpec.model_validate(small)
    from service.runner.search import make_sampler

    sampler = make_sampler(spec)
    assert isinstance(sampler, optuna.samplers.GridSampler)
    assert grid_points(spec) == len(sampler._all_grids) == 7 * 5 * 3

    # What Optuna stores per trial and parameter: its own `distribution_json` column.
    spec = StudySpec.model_validate({**VALID, "base": {"task": LM}, "search_space": {
        **VALID["search_space"],
        "task.valid_split": {"type": "categorical", "choices": ["valid", "v" * 300, "w"]},
        "model.n_layers": {"type": "int", "low": 1, "high": 4},
        "seed": {"type": "fixed", "value": 3},
    }})  # fmt: skip
    from service.runner.configs import suggest
    from service.store.optuna import optuna_storage

    storage = optuna_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    try:
        suggest(spec, optuna.create_study(storage=storage).ask())
        with storage.engine.connect() as conn:
            sql = text("SELECT param_name, distribution_json FROM trial_params")
            stored = {str(k): str(v) for k, v in conn.execute(sql).all()}
    finally:
        storage.engine.dispose()
    assert param_bytes_per_trial(spec) == {k: len(v.encode()) for k, v in stored.items()}

    for steps, every, init in [(300, 50, False), (301, 50, True), (7, 3, False), (1, 1, True)]:
        spec = StudySpec.model_validate(
            {**VALID, "base": {"steps": steps, "eval_every": every, "eval_at_init": init}}
        )
        evaluated = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
        assert evaluations(spec) == len(evaluated) + int(init), (steps, every, init)

    from workers.trial import TrialConfig, run_trial

    class Rows:
        def __init__(self) -> None:
            self.per_step: dict[int, int] = {}

        def report(self, step: int, metrics: list[Any], value: float | None) -> str | None:
            self.per_step[step] = len(metrics)
            return None

    for layers, heads in [(1, 1), (2, 4), (3, 2)]:
        config = TrialConfig.model_validate(
            {
                "steps": 2,
                "eval_every": 1,
                "eval_batches": 1,
                "batch_size": 4,
                "probe_batch_size": 2,
                "regularizer": {"kind": "spectral_variance", "lambda": 0.1},
                "model": {"n_layers": layers, "n_heads": heads, "d_model": 8 * heads},
                "task": {"seq_len": 20, "n_valid": 8},
            }
        )
        rows = Rows()
        run_trial(config, reporter=rows)
        measured = max(rows.per_step.values())
        # The estimate bounds every evaluation and is tight for a task with an answer key
        # and a regularizer (every series of the registry is measured).
        assert measured == metric_rows_per_evaluation(layers, heads), (layers, heads, rows)


def test_every_limit_is_a_documented_setting() -> None:
    """Each QKSCOPE_MAX_* setting and the inbox bound appear in docs/operations.md's
    table, with their default."""
    docs = (ROOT / "docs" / "operations.md").read_text()
    names = [n for n in Settings.model_fields if n.startswith(("max_", "inbox_"))]
    assert "max_grid_points" in names and "inbox_max_messages" in names
    for name in names:
        default = Settings.model_fields[name].default
        row = re.search(rf"^\| `QKSCOPE_{name.upper()}` \| ([^|]+) \|", docs, re.M)
        assert row is not None, name
        documented = row.group(1).strip().split(" ")[0].replace(",", "")
        unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}.get(row.group(1).split()[-1], 1)
        assert float(documented) * unit == default, (name, row.group(1), default)
