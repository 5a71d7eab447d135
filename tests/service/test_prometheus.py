"""GET /metrics: Prometheus exposition read from the database at scrape time, on real SQLite and
PostgreSQL (a fresh database per test, so every count is exactly what the test inserted). The
text is parsed with prometheus_client's own parser and compared with numbers worked out here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session

from service.app import create_app
from service.config import Settings
from service.control.ray_cluster import job_id_for
from service.store import Store, utcnow
from service.store.models import Study, Trial
from service.store.session import make_engine, make_sessionmaker

TOKEN = "prom-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STUDY_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED")
TRIAL_STATES = ("QUEUED", "RUNNING", "COMPLETE", "PRUNED", "DIVERGED", "FAILED", "CANCELLED")
FINISHED = TRIAL_STATES[2:]
BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0,
           43200.0, 86400.0, math.inf)  # fmt: skip


def make_client(url: str, home: Path) -> TestClient:
    settings = Settings(database_url=url, ray_address="", api_tokens=TOKEN, home=home)
    return TestClient(create_app(settings, reconcile_loop=False), headers=AUTH)


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with make_client(db_url, tmp_path) as c:
        yield c


@pytest.fixture
def engine(client: TestClient, db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.endswith("_created"):  # a timestamp, not a count
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def expected(
    studies: list[str],
    trials: list[tuple[str, float | None, int]],
    standbys: tuple[int, int] = (0, 0),
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Worked out from the inserted rows: (state, duration_s, metric_rows) per trial, and
    (ready, starting) standby rows."""
    want: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    want[("qkscope_standby_runners", (("state", "ready"),))] = float(standbys[0])
    want[("qkscope_standby_runners", (("state", "starting"),))] = float(standbys[1])
    want[("qkscope_reconcile_rounds_total", ())] = 0.0  # these apps run no reconcile loop
    for st in STUDY_STATES:
        want[("qkscope_studies", (("status", st),))] = float(studies.count(st))
    for st in TRIAL_STATES:
        want[("qkscope_trials", (("state", st),))] = float(sum(1 for t in trials if t[0] == st))
    for st in FINISHED:
        durations = [d for s, d, _ in trials if s == st and d is not None]
        for b in BUCKETS:
            le = "+Inf" if math.isinf(b) else str(b)
            n = sum(1 for d in durations if d <= b)
            want[("qkscope_trial_duration_seconds_bucket", (("le", le), ("state", st)))] = float(n)
        want[("qkscope_trial_duration_seconds_count", (("state", st),))] = float(len(durations))
        want[("qkscope_trial_duration_seconds_sum", (("state", st),))] = float(sum(durations))
    want[("qkscope_metric_rows_written_total", ())] = float(sum(m for _, _, m in trials))
    return want


def create_studies(client: TestClient, engine: Engine, statuses: list[str]) -> list[int]:
    ids = []
    for i, status in enumerate(statuses):
        r = client.post("/v1/studies", json={"name": f"prom-{i}", "budget": {"n_trials": 50}})
        assert r.status_code == 201, r.text
        ids.append(int(r.json()["id"]))
        with Session(engine) as s:
            s.execute(update(Study).where(Study.id == ids[-1]).values(status=status))
            s.commit()
    return ids


def add_trials(
    engine: Engine, study_id: int, trials: list[tuple[str, float | None, int]], first: int = 0
) -> None:
    with Session(engine) as s:
        s.add_all(
            Trial(study_id=study_id, number=first + i, state=st, params={}, duration_s=d,
                  metric_rows=m)
            for i, (st, d, m) in enumerate(trials)
        )  # fmt: skip
        s.commit()


def test_empty_database_exposes_every_series_at_zero(client: TestClient) -> None:
    got = scrape(client)
    assert got == expected([], [])


# Durations on bucket boundaries (le is inclusive), between them, beyond the last finite one,
# and missing (a trial that failed before it started, a running trial): the latter count as
# trials but not in the histogram.
TRIALS: list[tuple[str, float | None, int]] = [
    ("COMPLETE", 0.5, 120),
    ("COMPLETE", 1.0, 120),
    ("COMPLETE", 59.9, 480),
    ("COMPLETE", 60.0, 480),
    ("COMPLETE", 4000.0, 9000),
    ("PRUNED", 14.0, 60),
    ("PRUNED", 31.0, 75),
    ("DIVERGED", 2.5, 7),
    ("FAILED", None, 0),
    ("FAILED", 100000.0, 3),
    ("CANCELLED", 12.0, 0),
    ("RUNNING", None, 0),
    ("RUNNING", None, 0),
]


def test_counts_histogram_and_counter_match_the_inserted_rows(
    client: TestClient, engine: Engine
) -> None:
    statuses = ["PENDING", "RUNNING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "COMPLETED"]
    ids = create_studies(client, engine, statuses)
    add_trials(engine, ids[1], TRIALS[:7])
    add_trials(engine, ids[3], TRIALS[7:])
    got = scrape(client)
    assert got == expected(statuses, TRIALS)
    # Spot checks against numbers worked out by hand.
    assert got[("qkscope_trials", (("state", "COMPLETE"),))] == 5
    assert got[("qkscope_studies", (("status", "RUNNING"),))] == 2
    key = ("qkscope_trial_duration_seconds_bucket", (("le", "60.0"), ("state", "COMPLETE")))
    assert got[key] == 4  # 0.5, 1.0, 59.9 and 60.0
    key = ("qkscope_trial_duration_seconds_bucket", (("le", "+Inf"), ("state", "FAILED")))
    assert got[key] == 1  # the failed trial without a duration is not observed
    assert (
        got[("qkscope_metric_rows_written_total", ())]
        == 120 + 120 + 480 + 480 + 9000 + 60 + 75 + 7 + 3
    )


def test_scrapes_read_the_database_so_restarts_and_other_writers_are_seen(
    client: TestClient, engine: Engine, db_url: str, tmp_path: Path
) -> None:
    ids = create_studies(client, engine, ["RUNNING"])
    add_trials(engine, ids[0], TRIALS[:3])
    assert scrape(client) == expected(["RUNNING"], TRIALS[:3])
    # Another process (the runner) writes: this API instance sees it on the next scrape.
    add_trials(engine, ids[0], TRIALS[3:], first=3)
    with Session(engine) as s:
        s.execute(update(Trial).where(Trial.number == 0).values(metric_rows=121))
        s.commit()
    rows = [TRIALS[0][:2] + (121,), *TRIALS[1:]]
    assert scrape(client) == expected(["RUNNING"], rows)
    # A restarted (or second) API process starts from the database, not from zero.
    with make_client(db_url, tmp_path / "second") as other:
        assert scrape(other) == expected(["RUNNING"], rows)


def test_standbys_are_counted_apart_from_studies(client: TestClient, engine: Engine) -> None:
    """A standby row is no study: `qkscope_studies` ignores it; `qkscope_standby_runners`
    counts it ready while its heartbeat is fresh, starting otherwise (none yet, or stale)."""
    ids = create_studies(client, engine, ["RUNNING"])
    store = Store(make_sessionmaker(engine))
    ready, silent, stale = (store.standbys.add(job_id_for)[0] for _ in range(3))
    store.standbys.look(ready, heartbeat=True)
    store.standbys.look(stale, heartbeat=True)
    with Session(engine) as s:
        old = utcnow() - timedelta(minutes=1)
        s.execute(update(Study).where(Study.id == stale).values(started_at=old))
        s.commit()
    assert scrape(client) == expected(["RUNNING"], [], standbys=(1, 2))
    assert ids[0] not in (ready, silent, stale)


def test_openmetrics_is_served_when_asked_for(client: TestClient, engine: Engine) -> None:
    ids = create_studies(client, engine, ["COMPLETED"])
    add_trials(engine, ids[0], [("COMPLETE", 3.0, 10)])
    r = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    families = {f.name: f for f in parse_openmetrics(r.text)}  # type: ignore[no-untyped-call]
    assert families["qkscope_metric_rows_written"].type == "counter"
    assert families["qkscope_trial_duration_seconds"].type == "histogram"
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("qkscope_metric_rows_written_total", ())] == 10
    assert samples[("qkscope_trials", (("state", "COMPLETE"),))] == 1


def test_metrics_needs_the_token_and_healthz_does_not(client: TestClient) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
        assert "qkscope_" not in r.text
    assert client.get("/healthz", headers={"Authorization": ""}).status_code == 200
