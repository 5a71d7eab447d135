"""service.store.ingest.insert_metrics on real SQLite and PostgreSQL: rows land exactly once,
replays are no-ops, non-finite values become NULL, a batch is all or nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.store.ingest import insert_metrics
from service.store.migrate import upgrade
from service.store.models import NO_INDEX, Metric, Study, Trial
from service.store.session import make_engine, make_sessionmaker, session_scope


@pytest.fixture
def db(db_url: str) -> Iterator[tuple[sessionmaker[Session], list[int]]]:
    """A migrated database with one study and two trials; yields (sessions, trial ids)."""
    upgrade(db_url)
    engine = make_engine(db_url)
    sessions = make_sessionmaker(engine)
    with session_scope(sessions) as s:
        study = Study(name="ingest", spec={}, n_trials=2, optuna_study_name="ingest")
        s.add(study)
        s.flush()
        trials = [Trial(study_id=study.id, number=i) for i in range(2)]
        s.add_all(trials)
        s.flush()
        ids = [t.id for t in trials]
    try:
        yield sessions, ids
    finally:
        engine.dispose()


def rows(trial_id: int, steps: range, layers: int = 2, heads: int = 2) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for step in steps:
        out.append(
            {
                "trial_id": trial_id,
                "name": "val_loss",
                "step": step,
                "layer": NO_INDEX,
                "head": NO_INDEX,
                "value": 1.0 / (step + 1),
            }
        )
        for layer in range(layers):
            for head in range(heads):
                out.append(
                    {
                        "trial_id": trial_id,
                        "name": "attn_entropy_norm",
                        "step": step,
                        "layer": layer,
                        "head": head,
                        "value": 0.1 * layer + 0.01 * head + step,
                    }
                )
    return out


def stored(sessions: sessionmaker[Session], trial_id: int | None = None) -> list[tuple[Any, ...]]:
    with session_scope(sessions) as s:
        q = select(
            Metric.trial_id, Metric.name, Metric.layer, Metric.head, Metric.step, Metric.value
        )
        if trial_id is not None:
            q = q.where(Metric.trial_id == trial_id)
        return sorted(tuple(r) for r in s.execute(q).all())


def as_tuples(rs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted(
        (r["trial_id"], r["name"], r["layer"], r["head"], r["step"], r["value"]) for r in rs
    )


def test_rows_land_exactly_once(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, t2) = db
    batch = rows(t1, range(0, 100, 10)) + rows(t2, range(0, 50, 10))
    with session_scope(sessions) as s:
        assert insert_metrics(s, batch) == len(batch)
    assert stored(sessions) == as_tuples(batch)


def test_replay_is_a_no_op(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, _) = db
    batch = rows(t1, range(0, 100, 10))
    with session_scope(sessions) as s:
        insert_metrics(s, batch)
    before = stored(sessions)
    changed = [{**r, "value": -5.0} for r in batch]  # a replay never overwrites
    with session_scope(sessions) as s:
        assert insert_metrics(s, changed) == 0
    assert stored(sessions) == before


def test_partial_overlap_inserts_only_new_rows(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, _) = db
    first, second = rows(t1, range(0, 60, 10)), rows(t1, range(30, 90, 10))
    with session_scope(sessions) as s:
        insert_metrics(s, first)
    with session_scope(sessions) as s:
        new = insert_metrics(s, second)
    assert new == len(rows(t1, range(60, 90, 10)))
    assert stored(sessions) == as_tuples(rows(t1, range(0, 90, 10)))


def test_duplicates_within_one_batch(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, _) = db
    batch = rows(t1, range(3))
    with session_scope(sessions) as s:
        assert insert_metrics(s, batch + batch) == len(batch)
    assert stored(sessions) == as_tuples(batch)


def test_non_finite_values_are_null(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, _) = db
    batch = [
        {
            "trial_id": t1,
            "name": "grad_norm",
            "step": i,
            "layer": NO_INDEX,
            "head": NO_INDEX,
            "value": v,
        }
        for i, v in enumerate([math.nan, math.inf, -math.inf, None, 2.5, 0.0, -1e300])
    ]
    with session_scope(sessions) as s:
        insert_metrics(s, batch)
    assert [r[-1] for r in stored(sessions)] == [None, None, None, None, 2.5, 0.0, -1e300]


def test_two_batches_in_one_transaction(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, t2) = db
    a, b = rows(t1, range(5)), rows(t2, range(5))
    with session_scope(sessions) as s:
        assert insert_metrics(s, a) == len(a)
        assert insert_metrics(s, b) == len(b)
        assert insert_metrics(s, a) == 0
    assert stored(sessions) == as_tuples(a + b)


def test_a_failed_batch_leaves_nothing(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, t2) = db
    with pytest.raises(RuntimeError), session_scope(sessions) as s:
        insert_metrics(s, rows(t1, range(5)))
        raise RuntimeError("crash after the insert, before the commit")
    assert stored(sessions) == []
    # The next batch on the same pooled connection starts clean.
    with session_scope(sessions) as s:
        assert insert_metrics(s, rows(t2, range(2))) == len(rows(t2, range(2)))
    assert stored(sessions) == as_tuples(rows(t2, range(2)))


def test_large_batch_and_empty_batch(db: tuple[sessionmaker[Session], list[int]]) -> None:
    sessions, (t1, _) = db
    batch = rows(t1, range(3000), layers=2, heads=2)  # 15,000 rows: several chunks anywhere
    with session_scope(sessions) as s:
        assert insert_metrics(s, []) == 0
        assert insert_metrics(s, batch) == len(batch)
    with session_scope(sessions) as s:
        assert s.scalar(select(func.count()).select_from(Metric)) == len(batch)
