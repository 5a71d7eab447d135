"""Alembic migrations on real SQLite and PostgreSQL, beside Optuna's tables in the same database."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import optuna
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, inspect, text
from sqlalchemy.orm import Session

from service.store.migrate import alembic_config, upgrade
from service.store.models import Base, Study
from service.store.session import normalize_url

ENV_PY = Path(__file__).resolve().parents[2] / "migrations" / "env.py"
OURS = {"qk_study", "qk_trial", "qk_metric"}


def _from_env_py() -> tuple[Any, str]:
    """`include_object` and `VERSION_TABLE` exactly as migrations/env.py defines them.

    env.py runs the migrations when imported, so only those two definitions are compiled.
    """
    tree = ast.parse(ENV_PY.read_text())
    keep = [
        n
        for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name == "include_object")
        or (
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "VERSION_TABLE" for t in n.targets)
        )
    ]
    assert len(keep) == 2, "migrations/env.py must define include_object and VERSION_TABLE"
    ns: dict[str, Any] = {"Any": Any}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(ENV_PY), "exec"), ns)
    return ns["include_object"], ns["VERSION_TABLE"]


include_object, VERSION_TABLE = _from_env_py()


@pytest.fixture
def engine(db_url: str) -> Any:
    eng = create_engine(normalize_url(db_url))
    yield eng
    eng.dispose()


def tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def snapshot(engine: Engine, names: set[str]) -> dict[str, list[str]]:
    """Every row of every named table, order-independent."""
    out: dict[str, list[str]] = {}
    with engine.connect() as conn:
        for name in sorted(names):
            rows = conn.execute(text(f'SELECT * FROM "{name}"')).all()
            out[name] = sorted(repr(tuple(r)) for r in rows)
    return out


def optuna_study(url: str, name: str, n_trials: int) -> list[float]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(normalize_url(url))
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction="minimize",
        sampler=optuna.samplers.RandomSampler(seed=3),
    )
    study.optimize(lambda t: (t.suggest_float("x", -1.0, 1.0) - 0.2) ** 2, n_trials=n_trials)
    values = [t.value for t in study.trials]
    storage.remove_session()
    return [float(v) for v in values if v is not None]


def load_values(url: str, name: str) -> list[float]:
    storage = optuna.storages.RDBStorage(normalize_url(url))
    study = optuna.load_study(study_name=name, storage=storage)
    values = [float(t.value) for t in study.trials if t.value is not None]
    storage.remove_session()
    return values


def test_env_py_filter_and_version_table() -> None:
    assert VERSION_TABLE == "qkscope_alembic_version"
    for name in (
        "studies",
        "trials",
        "trial_params",
        "trial_values",
        "alembic_version",
        "version_info",
        "qkscope_alembic_version",
    ):
        assert include_object(None, name, "table", True, None) is False, name
    for name in OURS:
        assert include_object(None, name, "table", False, None) is True
    idx = Base.metadata.tables["qk_trial"].indexes
    assert all(include_object(i, i.name, "index", False, None) for i in idx)


def test_upgrade_creates_our_tables_and_own_version_table(db_url: str, engine: Engine) -> None:
    upgrade(db_url)
    assert tables(engine) == OURS | {"qkscope_alembic_version"}
    assert "alembic_version" not in tables(engine)
    head = ScriptDirectory.from_config(alembic_config(db_url)).get_current_head()
    with engine.connect() as conn:
        assert conn.execute(
            text("SELECT version_num FROM qkscope_alembic_version")
        ).scalars().all() == [head]
    cols = {c["name"] for c in inspect(engine).get_columns("qk_trial")}
    assert {"params", "values", "final_val_loss", "min_norm_entropy", "entropy_collapse"} <= cols


def test_optuna_tables_and_data_survive_upgrades(db_url: str, engine: Engine) -> None:
    before_values = optuna_study(db_url, "made-before", 5)
    assert len(before_values) == 5
    optuna_tables = tables(engine)
    assert {"studies", "trials", "alembic_version"} <= optuna_tables and not optuna_tables & OURS
    optuna_snap = snapshot(engine, optuna_tables)

    upgrade(db_url)
    assert tables(engine) == optuna_tables | OURS | {"qkscope_alembic_version"}
    assert snapshot(engine, optuna_tables) == optuna_snap  # incl. Optuna's own alembic_version
    assert load_values(db_url, "made-before") == before_values

    after_values = optuna_study(db_url, "made-after", 3)
    with Session(engine) as s:
        s.add(Study(name="kept", spec={"name": "kept"}, n_trials=1, optuna_study_name="qkscope-1"))
        s.commit()
    everything = tables(engine)
    full = snapshot(engine, everything)

    upgrade(db_url)  # a second upgrade is a no-op: same tables, same rows, same versions
    assert tables(engine) == everything
    assert snapshot(engine, everything) == full
    assert load_values(db_url, "made-before") == before_values
    assert load_values(db_url, "made-after") == after_values
    assert len(optuna.study.get_all_study_names(normalize_url(db_url))) == 2


def test_autogenerate_finds_no_difference_and_ignores_optuna(db_url: str, engine: Engine) -> None:
    optuna_study(db_url, "neighbour", 2)
    upgrade(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "include_object": include_object,
                "compare_type": True,
                "version_table": VERSION_TABLE,
                "target_metadata": Base.metadata,
            },
        )
        assert compare_metadata(ctx, Base.metadata) == []
        # Without the filter autogenerate would drop Optuna's tables: the filter is what saves them.
        bare = MigrationContext.configure(
            conn, opts={"compare_type": True, "version_table": VERSION_TABLE}
        )
        removed = {
            d[1].name
            for d in compare_metadata(bare, Base.metadata)
            if isinstance(d, tuple) and d[0] == "remove_table"
        }
        assert {"studies", "trials"} <= removed
    command.check(alembic_config(db_url))  # `alembic check` through env.py: raises on a diff


def test_downgrade_to_base_drops_only_our_tables(db_url: str, engine: Engine) -> None:
    values = optuna_study(db_url, "survivor", 3)
    optuna_tables = tables(engine)
    snap = snapshot(engine, optuna_tables)
    upgrade(db_url)
    command.downgrade(alembic_config(db_url), "base")
    assert tables(engine) == optuna_tables | {"qkscope_alembic_version"}
    assert snapshot(engine, optuna_tables) == snap
    assert load_values(db_url, "survivor") == values
    upgrade(db_url)
    assert tables(engine) >= OURS


def test_0006_charges_earlier_relaunches_as_failures(db_url: str, engine: Engine) -> None:
    """A study's earlier relaunches counted against max_job_attempts under the old rule
    (`job_attempts`): after the upgrade they are its `job_failures`, so an upgrade gives no
    study its attempts back."""
    command.upgrade(alembic_config(db_url), "0005")
    with engine.begin() as conn:
        for name, attempts in (("fresh", 0), ("once", 1), ("thrice", 3)):
            conn.execute(
                text(
                    "INSERT INTO qk_study (name, status, spec, n_trials, optuna_study_name,"
                    " job_attempts, created_at) VALUES (:n, 'RUNNING', '{}', 1, :n, :a,"
                    " CURRENT_TIMESTAMP)"
                ),
                {"n": name, "a": attempts},
            )
    upgrade(db_url)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT name, job_attempts, job_failures, weather_relaunches FROM qk_study")
        ).all()
    assert sorted(tuple(r) for r in rows) == [
        ("fresh", 0, 0, 0),
        ("once", 1, 0, 0),
        ("thrice", 3, 2, 0),
    ]
