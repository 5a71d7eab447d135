"""Issue 42, item 5: reads in bounded memory, however long the trials.

A trial's summary keeps one entry per evaluation (`eval_steps`, `val_losses`: about 251 KiB
of JSON at 10,000 evaluations). The read routes loaded whole rows: `/best` about 310 MiB a
request at 300 such trials, `/importance` as much, a page of `/trials` up to 1,000 of them.
Here 300 COMPLETE trials of 10,000 evaluations each, on SQLite and PostgreSQL, and the peak
of Python memory (tracemalloc) while each route answers, against a bound the old code
passed many times over; what the routes answer is checked against the stored rows.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert, select

from service.app import create_app
from service.config import Settings
from service.read.best import pareto_front
from service.read.summaries import MAX_PLATEAUS, SERIES_KEYS, trim
from service.store import Study, Trial, make_engine, make_sessionmaker, migrate, session_scope

N_TRIALS = 300
EVALS = 10_000
PEAK_BOUND = 24 * 2**20  # bytes of Python memory one read may peak at (the old code: >200 MiB)

SPEC = {
    "name": "long",
    "search_space": {
        "regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
    },
    "budget": {"n_trials": N_TRIALS},
    "objectives": [
        {"metric": "final_val_loss", "direction": "minimize"},
        {"metric": "min_norm_entropy", "direction": "maximize"},
    ],
}


_STEPS = list(range(1, EVALS + 1))
_LOSSES = [round(random.Random(3).uniform(0.5, 3.0), 15) for _ in _STEPS]  # shared: cheap


def _summary(rng: random.Random, loss: float, entropy: float) -> dict[str, Any]:
    return {
        "status": "completed",
        "steps_done": EVALS,
        "final_val_loss": loss,
        "best_val_loss": loss - 0.01,
        "min_norm_entropy": entropy,
        "eval_steps": _STEPS,
        "val_losses": _LOSSES,
        "plateaus": [[10 * i, 10 * i + 5] for i in range(MAX_PLATEAUS + 20)],
    }


@pytest.fixture(scope="module")
def seeded(module_db_url: str) -> Iterator[tuple[str, int, dict[int, dict[str, Any]]]]:
    """A study of N_TRIALS COMPLETE trials, each with a 10,000-evaluation summary; the first
    10 on a Pareto front of (loss, entropy), the rest behind it."""
    migrate.upgrade(module_db_url)
    engine = make_engine(module_db_url)
    sessions = make_sessionmaker(engine)
    rng = random.Random(0)
    with session_scope(sessions) as s:
        study = Study(
            name="long", status="RUNNING", spec=SPEC, n_trials=N_TRIALS, optuna_study_name="x"
        )
        s.add(study)
        s.flush()
        study_id = study.id
    stored: dict[int, dict[str, Any]] = {}
    rows = []
    for number in range(N_TRIALS):
        front = number < 10
        loss = 1.0 + 0.1 * number if front else 3.0 + rng.random()
        entropy = 0.45 + 0.05 * number if front else 0.1 * rng.random()
        stored[number] = summary = _summary(rng, loss, entropy)
        params = {"regularizer.lambda": 10 ** rng.uniform(-4, 0), "model.qk_init_std": 0.5}
        rows.append(
            {
                "study_id": study_id,
                "number": number,
                "state": "COMPLETE",
                "params": params,
                "value": loss,
                "values": [loss, entropy],
                "feasible": True,
                "summary": summary,
                "final_val_loss": loss,
                "min_norm_entropy": entropy,
                "last_step": EVALS,
            }
        )
    for start in range(0, N_TRIALS, 50):
        with session_scope(sessions) as s:
            s.execute(insert(Trial), rows[start : start + 50])
    engine.dispose()
    yield module_db_url, study_id, stored


@pytest.fixture(scope="module")
def client(
    seeded: tuple[str, int, dict[int, dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    home: Path = tmp_path_factory.mktemp("home")
    settings = Settings(database_url=seeded[0], ray_address="", api_tokens="", home=home)
    with TestClient(create_app(settings, reconcile_loop=False)) as c:
        yield c


def _peak(call: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = call()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak


def _shown(summary: dict[str, Any]) -> dict[str, Any]:
    """The stored summary as a read route shows it, computed here from the stored dict."""
    out = {k: v for k, v in summary.items() if k not in ("eval_steps", "val_losses")}
    out["plateaus"] = summary["plateaus"][-100:]
    out["plateaus_left_out"] = len(summary["plateaus"]) - 100
    return out


def test_best_answers_the_front_in_bounded_memory(
    client: TestClient, seeded: tuple[str, int, dict[int, dict[str, Any]]]
) -> None:
    _, study_id, stored = seeded
    r, peak = _peak(lambda: client.get(f"/v1/studies/{study_id}/best"))
    assert r.status_code == 200, r.text
    assert peak < PEAK_BOUND, f"{peak / 2**20:.1f} MiB"
    front = r.json()
    assert [t["number"] for t in front] == list(range(10))  # by loss, the first objective
    for t in front:
        assert t["summary"] == _shown(stored[t["number"]])


def test_importance_reads_in_bounded_memory(
    client: TestClient, seeded: tuple[str, int, dict[int, dict[str, Any]]]
) -> None:
    """A column target and one read from the summary JSON (`best_val_loss`). Optuna's and
    scipy's modules are imported by a first ranking outside the measure (a cached ranking
    is per target: the measured ones are computed)."""
    _, study_id, _ = seeded
    warm = client.get(f"/v1/studies/{study_id}/importance?target=value&evaluator=ped_anova")
    assert warm.status_code == 200, warm.text
    for target in ("min_norm_entropy", "best_val_loss"):
        url = f"/v1/studies/{study_id}/importance?target={target}&evaluator=ped_anova"
        r, peak = _peak(lambda u=url: client.get(u))  # type: ignore[misc]
        assert r.status_code == 200, r.text
        assert r.json()["n_trials"] == N_TRIALS
        assert peak < PEAK_BOUND, (target, f"{peak / 2**20:.1f} MiB")


def test_a_trial_and_a_page_of_trials_are_bounded(
    client: TestClient, seeded: tuple[str, int, dict[int, dict[str, Any]]]
) -> None:
    _, study_id, stored = seeded
    r, peak = _peak(lambda: client.get(f"/v1/studies/{study_id}/trials?limit=1000"))
    assert r.status_code == 200 and r.json()["total"] == N_TRIALS
    assert all(t["summary"] is None for t in r.json()["items"])
    assert peak < PEAK_BOUND, f"{peak / 2**20:.1f} MiB"
    tid = r.json()["items"][3]["id"]
    one = client.get(f"/v1/trials/{tid}").json()
    assert one["summary"] == _shown(stored[3])
    assert not set(SERIES_KEYS) & set(one["summary"])
    # The per-evaluation validation loss is the metric route's (none stored here: no rows).
    assert client.get(f"/v1/trials/{tid}/metrics?name=val_loss").json() == []


def test_trim_and_the_database_agree() -> None:
    """`trim` (Python) is what the database's `bounded_summary` and the plateau cut give."""
    rng = random.Random(1)
    s = _summary(rng, 1.0, 0.5)
    assert trim(s) == _shown(s)
    small = {"status": "completed", "plateaus": [[1, 2]], "eval_steps": [1], "val_losses": [2.0]}
    assert trim(small) == {"status": "completed", "plateaus": [[1, 2]]}


def test_the_pareto_front_is_the_brute_force_one() -> None:
    """Against the definition (no other point no worse everywhere and different), on random
    points with ties, in 1 to 4 objectives."""
    rng = random.Random(7)
    for dims in (1, 2, 3, 4):
        for _ in range(30):
            keys = [(i, tuple(float(rng.randrange(6)) for _ in range(dims))) for i in range(40)]
            brute = {
                i
                for i, a in keys
                if not any(
                    b != a and all(x <= y for x, y in zip(b, a, strict=True)) for _, b in keys
                )
            }
            assert set(pareto_front(keys)) == brute


def test_no_route_loads_a_whole_summary(
    client: TestClient, seeded: tuple[str, int, dict[int, dict[str, Any]]]
) -> None:
    """The stored summaries are untouched: the database still holds every evaluation."""
    url, study_id, stored = seeded
    engine = make_engine(url)
    try:
        with session_scope(make_sessionmaker(engine)) as s:
            row = s.scalars(
                select(Trial).where(Trial.study_id == study_id, Trial.number == 5)
            ).one()
            assert row.summary == stored[5]
    finally:
        engine.dispose()
