"""Issue 32, item 2: a runner that cannot be built failed nothing. `StudyRunner.__init__` raised
before there was a runner to mark the study FAILED, the job died, and the reconciler
relaunched the study `QKSCOPE_MAX_JOB_ATTEMPTS` times, each failing the same way (a grid
Optuna builds as a 1e9-point list: under a memory cap, a MemoryError five times). Now such a
failure fails the study once, with its reason; a database that does not answer or a Ray
error is no verdict and leaves the study as it was. Real runners, real databases, real
Optuna; the memory cap is a real RLIMIT_AS on a real runner process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import optuna
import pytest
import ray
from sqlalchemy import create_engine, text

from service.config import Settings
from service.runner.job import is_weather, run_study
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.models import StudyStatus
from service.store.session import make_engine, make_sessionmaker
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[3]


def _grid(n: int, low: float, high: float) -> dict[str, Any]:
    step = (high - low) / (n - 1)
    return {"type": "float", "low": low, "high": high, "grid": [low + step * i for i in range(n)]}


# Accepted where QKSCOPE_MAX_GRID_POINTS was raised past what the runner's node holds (or
# stored before the limit existed): Optuna's GridSampler builds its 1e9 points as a list.
GRID_1E9: dict[str, Any] = {
    "name": "huge-grid",
    "sampler": {"kind": "grid"},
    "budget": {"n_trials": 4},
    "search_space": {
        "optim.lr": _grid(1000, 1e-4, 1e-2),
        "model.qk_init_std": _grid(1000, 0.01, 1.0),
        "regularizer.lambda": _grid(1000, 0.0, 1.0),
    },
}

# A runner process whose address space is capped 512 MiB above what its imports use.
RUNNER = textwrap.dedent(
    """
    import resource, sys
    from service.config import Settings
    from service.runner.job import run_study
    used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    cap = used + 512 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    run_study(int(sys.argv[1]), Settings(database_url=sys.argv[2], home=sys.argv[3]))
    """
)


def _store(url: str) -> tuple[Store, Any]:
    migrate.upgrade(url)
    engine = make_engine(url)
    return Store(make_sessionmaker(engine)), engine


def test_a_grid_that_does_not_fit_fails_the_study_once_with_its_reason(
    db_url: str, tmp_path: Path
) -> None:
    store, engine = _store(db_url)
    try:
        row, _ = store.studies.create(StudySpec.model_validate(GRID_1E9))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            [sys.executable, "-c", RUNNER, str(row.id), db_url, str(tmp_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode != 0, run.stdout
        assert "MemoryError" in run.stderr, run.stderr[-2000:]
        study = store.studies.get(row.id)
        assert study is not None
        assert study.status == StudyStatus.FAILED, (study.status, run.stderr[-2000:])
        assert "could not be built" in (study.error or "")
        assert "MemoryError" in (study.error or "")
        # FAILED is terminal: the reconciler has nothing to relaunch.
        assert row.id not in [r[0] for r in store.studies.live()]
    finally:
        engine.dispose()


def test_a_stored_definition_this_code_refuses_fails_once(db_url: str, tmp_path: Path) -> None:
    """A study stored by an earlier version whose definition this one refuses (a field it no
    longer knows): no relaunch can build its runner, so it fails at the first."""
    store, engine = _store(db_url)
    try:
        spec = StudySpec.model_validate({"name": "old", "budget": {"n_trials": 2}})
        row, _ = store.studies.create(spec)
        with engine.begin() as conn:  # the row as an older version wrote it
            stored = {**row.spec, "retired_field": 1}
            conn.execute(
                text("UPDATE qk_study SET spec = :s WHERE id = :i"),
                {"s": json.dumps(stored), "i": row.id},
            )
        settings = Settings(database_url=db_url, home=tmp_path)
        with pytest.raises(ValueError, match="retired_field"):
            run_study(row.id, settings)
        study = store.studies.get(row.id)
        assert study is not None and study.status == StudyStatus.FAILED
        assert "retired_field" in (study.error or "")
        assert row.id not in [r[0] for r in store.studies.live()]
    finally:
        engine.dispose()


def test_a_database_or_ray_error_is_no_verdict() -> None:
    """What the build may raise when the cluster, not the study, failed: real errors."""
    closed = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x")
    try:
        with closed.connect():
            pass
    except Exception as e:  # a real OperationalError: connection refused
        refused: BaseException = e
    else:
        raise AssertionError("a closed port accepted a connection")
    finally:
        closed.dispose()
    assert is_weather(refused)
    try:  # Optuna's storage wraps it
        try:
            raise refused
        except Exception as e:
            raise optuna.exceptions.StorageInternalError("storage failed") from e
    except Exception as e:
        assert is_weather(e)
    assert is_weather(ray.exceptions.RaySystemError("the head restarted"))
    for verdict in (MemoryError(), ValueError("bad grid"), ImportError("no cmaes"), KeyError("x")):
        assert not is_weather(verdict), verdict
