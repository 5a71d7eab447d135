"""penalty_version: every trial says which eigenspectrum-penalty definition trained it.

Rows stored before migration 0003 were trained with the v1 LocAteR-style penalty and must
read 1 after the upgrade (SQLite and PostgreSQL); new rows get the current version; the
trials API shows, filters and sorts on it; the export carries it.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, inspect, select, text
from sqlalchemy.orm import Session

from service.store.migrate import alembic_config, upgrade
from service.store.models import CURRENT_PENALTY_VERSION, Study, Trial
from service.store.session import normalize_url
from tests.service.conftest import create_via_api
from workers.regularizers import PENALTY_VERSION


def test_service_constant_matches_the_workers_penalty_version() -> None:
    """The torch-free copy the service labels trials with is the version workers train with."""
    assert CURRENT_PENALTY_VERSION == PENALTY_VERSION == 2


def test_rows_from_before_the_migration_keep_label_1(db_url: str) -> None:
    command.upgrade(alembic_config(db_url), "0002")
    eng = create_engine(normalize_url(db_url))
    try:
        with eng.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO qk_study (name, status, spec, n_trials, optuna_study_name,"
                    " job_attempts, created_at) VALUES ('old', 'COMPLETED', '{}', 2, 'qkscope-1',"
                    " 0, CURRENT_TIMESTAMP)"
                )
            )
            sid = conn.execute(text("SELECT id FROM qk_study")).scalar_one()
            for n in (0, 1):
                conn.execute(
                    text(
                        "INSERT INTO qk_trial (study_id, number, state, params, seed, attempts,"
                        " last_step, started_at, final_val_loss) VALUES (:s, :n, 'COMPLETE', '{}',"
                        " 0, 1, 100, CURRENT_TIMESTAMP, :v)"
                    ),
                    {"s": sid, "n": n, "v": 3.0 + n},
                )
        upgrade(db_url)
        col = {c["name"]: c for c in inspect(eng).get_columns("qk_trial")}["penalty_version"]
        assert col["nullable"] is False
        with Session(eng) as s:
            old = s.scalars(select(Trial).order_by(Trial.number)).all()
            assert [(t.number, t.penalty_version, t.final_val_loss) for t in old] == [
                (0, 1, 3.0),
                (1, 1, 4.0),
            ]
            study = s.get(Study, sid)
            assert study is not None
            s.add(Trial(study_id=sid, number=2, params={}))  # a new row: the current version
            s.commit()
            versions = s.execute(select(Trial.number, Trial.penalty_version)).all()
        assert sorted(versions) == [(0, 1), (1, 1), (2, CURRENT_PENALTY_VERSION)]
        command.downgrade(alembic_config(db_url), "0002")
        cols = {c["name"] for c in inspect(eng).get_columns("qk_trial")}
        assert "penalty_version" not in cols and "final_val_loss" in cols
    finally:
        eng.dispose()


def _seed(client: TestClient, engine: Engine) -> int:
    sid = create_via_api(
        client,
        {
            "name": "versions",
            "budget": {"n_trials": 6},
            "search_space": {"regularizer.lambda": {"type": "float", "low": 0.0, "high": 1.0}},
        },
    )
    with Session(engine) as s:
        for n in range(6):
            s.add(
                Trial(
                    study_id=sid,
                    number=n,
                    state="COMPLETE",
                    params={"regularizer.lambda": n / 10},
                    final_val_loss=5.0 - n,
                    penalty_version=1 if n % 2 == 0 else 2,
                )
            )
        s.commit()
    return sid


def _numbers(r: Any) -> list[int]:
    assert r.status_code == 200, r.text
    return [t["number"] for t in r.json()["items"]]


def test_api_shows_filters_and_sorts_on_penalty_version(client: TestClient, engine: Engine) -> None:
    sid = _seed(client, engine)
    url = f"/v1/studies/{sid}/trials"
    r = client.get(url)
    assert {t["number"]: t["penalty_version"] for t in r.json()["items"]} == {
        0: 1,
        1: 2,
        2: 1,
        3: 2,
        4: 1,
        5: 2,
    }
    assert _numbers(client.get(url, params={"penalty_version": 1})) == [0, 2, 4]
    assert _numbers(client.get(url, params={"penalty_version": 2})) == [1, 3, 5]
    assert _numbers(client.get(url, params={"penalty_version": [1, 2]})) == list(range(6))
    assert _numbers(client.get(url, params={"where": "penalty_version>=2"})) == [1, 3, 5]
    both = {"penalty_version": 2, "where": "final_val_loss<2.5"}
    assert _numbers(client.get(url, params=both)) == [3, 5]
    assert _numbers(client.get(url, params={"sort": "-penalty_version"})) == [1, 3, 5, 0, 2, 4]
    assert client.get(url, params={"penalty_version": 0}).status_code == 422
    bad = client.get(url, params={"penalty_version": "v2"})
    assert bad.status_code == 422 and "penalty_version" in bad.text
    one = client.get(f"/v1/trials/{r.json()['items'][1]['id']}").json()
    assert one["penalty_version"] == 2


def test_export_has_the_penalty_version_column(client: TestClient, engine: Engine) -> None:
    sid = _seed(client, engine)
    r = client.get(f"/v1/studies/{sid}/export", params={"format": "csv"})
    assert r.status_code == 200, r.text
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert {int(row["number"]): int(row["penalty_version"]) for row in rows} == {
        n: 1 if n % 2 == 0 else 2 for n in range(6)
    }
