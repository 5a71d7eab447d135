"""Everything the service derives from the metric registry, checked against the real thing:
the ORM columns, the spec's metric names, pruning's intermediate values (against real trial
summaries), `where=`/`sort=` on every summary field (SQLite and PostgreSQL), the metric
route's names, export and plot fields, and `metric_rows` of cancelled trials."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import Boolean, Engine, Float, Integer, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.api.schemas import TrialOut
from service.read.export import trial_columns
from service.read.plots.common import FLAG_FIELDS, KNOWN_METRICS, NUMERIC_FIELDS
from service.read.queries import SORTABLE
from service.runner.pruning import IntermediateTracker, Point, load_tracker
from service.spec import StudySpec
from service.store.models import SUMMARY_COLUMNS, Metric, Study, Trial
from service.store.trials import TrialRows
from tests.service.conftest import create_via_api
from tests.workers.test_trial import Recorder, tiny
from workers.metric_names import (
    COLUMN_SUMMARIES,
    FLAG_SUMMARIES,
    INTERMEDIATE_SUMMARIES,
    NUMERIC_SUMMARIES,
    OBJECTIVE_SUMMARIES,
    SERIES_NAMES,
    SUMMARIES,
    SUMMARY_BY_NAME,
    SUMMARY_NAMES,
)
from workers.trial import MetricPoint, TrialSummary, run_trial

# ---- the ORM, the API schema, plots and export --------------------------------------------


def test_trial_columns_are_the_registry_column_summaries() -> None:
    assert SUMMARY_COLUMNS == COLUMN_SUMMARIES
    columns = Trial.__table__.columns
    # every Trial column named like a summary metric is one of the registry's columns ...
    assert {c.name for c in columns if c.name in SUMMARY_NAMES} == set(COLUMN_SUMMARIES)
    # ... with the registry's type
    sql_type = {"float": Float, "int": Integer, "bool": Boolean}
    for name in COLUMN_SUMMARIES:
        assert isinstance(columns[name].type, sql_type[SUMMARY_BY_NAME[name].type]), name
    assert set(COLUMN_SUMMARIES) <= set(TrialOut.model_fields)


def test_plot_and_export_fields_cover_the_registry() -> None:
    assert set(KNOWN_METRICS) == set(SERIES_NAMES)
    assert set(NUMERIC_SUMMARIES) <= set(NUMERIC_FIELDS)
    assert set(FLAG_SUMMARIES) <= set(FLAG_FIELDS)
    assert set(SUMMARY_NAMES) <= set(SORTABLE)


def test_export_has_a_typed_column_per_summary(client: TestClient, engine: Engine) -> None:
    sid = create_via_api(client, {"name": "export-cols", "budget": {"n_trials": 1}})
    with Session(engine) as s:
        study = s.get(Study, sid)
        assert study is not None
        cols = dict(trial_columns(s, study))
    arrow = {"float": "float64", "int": "int64", "bool": "bool"}
    for m in SUMMARIES:
        assert cols[m.name] == arrow[m.type], m.name


# ---- the spec ----------------------------------------------------------------------------


def _spec(**over: Any) -> dict[str, Any]:
    return {"name": "s", "budget": {"n_trials": 2}, **over}


@pytest.mark.parametrize("metric", INTERMEDIATE_SUMMARIES)
def test_every_intermediate_summary_is_accepted_for_pruning(metric: str) -> None:
    spec = StudySpec.model_validate(
        _spec(
            objectives=[{"metric": metric, "direction": "minimize"}],
            pruner={"kind": "median"},
            constraints=[{"metric": metric, "op": "<=", "value": 1.0}],
        )
    )
    assert spec.objectives[0].metric == metric


@pytest.mark.parametrize("where", ["objectives", "constraints"])
def test_unknown_summary_metric_names_the_field(where: str) -> None:
    entry: dict[str, Any] = {"metric": "val_loss"}  # a series, not a summary
    if where == "constraints":
        entry |= {"op": ">=", "value": 1.0}
    with pytest.raises(ValidationError) as e:
        StudySpec.model_validate(_spec(**{where: [entry]}))
    err = e.value.errors()[0]
    assert err["loc"] == (where, 0, "metric")
    assert "final_val_loss" in err["msg"]  # the message lists the accepted names


def test_spec_schema_lists_the_objective_metrics() -> None:
    schema = StudySpec.model_json_schema()
    metric = schema["$defs"]["Objective"]["properties"]["metric"]
    assert metric["enum"] == list(OBJECTIVE_SUMMARIES)


# ---- intermediate values for pruning -------------------------------------------------------


def _points(points: list[MetricPoint]) -> list[Point]:
    return [(p.name, p.layer, p.head, p.value) for p in points]


PLATEAU_TRIAL: dict[str, Any] = {
    "optim": {"schedule": "constant"},  # so a shorter run is a prefix of a longer one
    "eval_every": 5,
    "plateau_window": 1,
    "plateau_rel_tol": 0.02,
    "regularizer": {"kind": "locater", "lambda": 0.01},
}


def _summary_value(summary: TrialSummary, name: str) -> float | None:
    v = getattr(summary, name)
    return None if v is None else float(v)


def test_intermediate_values_from_real_reports_are_the_summary_had_it_stopped_there() -> None:
    """Every intermediate summary: a value after every evaluation; at step k it equals the
    summary of the same trial run for k steps only (an independent run and code path)."""
    long_rec, short_rec = Recorder(), Recorder()
    long = run_trial(tiny(steps=40, **PLATEAU_TRIAL), long_rec)
    short = run_trial(tiny(steps=20, **PLATEAU_TRIAL), short_rec)
    assert long.longest_plateau > 0  # the plateau metrics are exercised, not all zero
    for metric in INTERMEDIATE_SUMMARIES:
        tracker = IntermediateTracker(metric, 1, 0.02)
        for step, points in long_rec.reports:
            tracker.add(step, _points(points))
            assert tracker.value(step) is not None, (metric, step)
        for stop, summary in ((20, short), (40, long)):
            want = _summary_value(summary, metric)
            assert want is not None, metric
            assert tracker.value(stop) == pytest.approx(want, rel=1e-9, abs=1e-12), (metric, stop)


def _val(step: int, v: float) -> list[Point]:
    return [("val_loss", None, None, v), ("train_loss", None, None, v + 1.0)]


# Validation losses with a plateau the run escapes (steps 20..40) and one it is on at 80.
CURVE = [(10, 5.0), (20, 4.0), (30, 3.99), (40, 3.98), (50, 3.0), (60, 2.0), (70, 1.99), (80, 1.98)]
# Hand-computed (window 1, rel_tol 0.05): (plateau_count, plateau_steps, longest_plateau).
PLATEAUS_AT = {30: (0, 0, 10), 40: (0, 0, 20), 50: (1, 20, 20), 80: (1, 20, 20)}


@pytest.mark.parametrize("metric", ["plateau_count", "plateau_steps", "longest_plateau"])
def test_plateau_intermediate_values_by_hand(metric: str) -> None:
    tracker = IntermediateTracker(metric, 1, 0.05)
    for step, v in CURVE:
        tracker.add(step, _val(step, v))
    i = ("plateau_count", "plateau_steps", "longest_plateau").index(metric)
    for step, want in PLATEAUS_AT.items():
        assert tracker.value(step) == want[i], step


def test_best_and_ever_are_running_minima() -> None:
    best = IntermediateTracker("best_val_loss", 1, 0.05)
    ever = IntermediateTracker("min_norm_entropy_ever", 1, 0.05)
    ents = {10: [0.5, 0.4], 20: [0.3, 0.6], 30: [0.7, 0.8]}
    for (step, v), up in zip(CURVE[:3], (5.0, 6.0, 7.0), strict=True):
        best.add(step, _val(step, v + up))  # rising losses: the best stays the first
        ever.add(step, [("attn_entropy_norm", 1, h, e) for h, e in enumerate(ents[step])])
    assert [best.value(s) for s in (10, 20, 30)] == [10.0, 10.0, 10.0]
    assert [ever.value(s) for s in (10, 20, 30)] == [0.4, 0.3, 0.3]


def test_non_intermediate_metrics_are_refused() -> None:
    for name in set(SUMMARY_NAMES) - set(INTERMEDIATE_SUMMARIES):
        with pytest.raises(ValueError, match="no intermediate value"):
            IntermediateTracker(name, 1, 0.05)


def test_tracker_rebuilt_from_stored_rows_uses_the_trials_own_plateau_settings(
    client: TestClient, engine: Engine
) -> None:
    """What a resumed runner does: the curve so far from the database, and the trial's
    own `plateau_rel_tol` (searched here) rather than the base config's."""
    sid = create_via_api(
        client,
        _spec(
            base={"plateau_window": 1, "plateau_rel_tol": 0.5},
            search_space={"plateau_rel_tol": {"type": "float", "low": 0.01, "high": 0.9}},
        ),
    )
    with Session(engine) as s:
        trial = Trial(study_id=sid, number=0, params={"plateau_rel_tol": 0.05})
        s.add(trial)
        s.flush()
        s.add_all(
            Metric(trial_id=trial.id, name=n, layer=-1, head=-1, step=step, value=v)
            for step, value in CURVE[:5]
            for n, _l, _h, v in _val(step, value)
        )
        s.commit()
        row_id = trial.id
    spec = StudySpec.model_validate(_spec(base={"plateau_window": 1, "plateau_rel_tol": 0.5}))
    params, rows = TrialRows(sessionmaker(engine)).metric_points(row_id, "val_loss")
    tracker = load_tracker("plateau_count", spec.base, params, rows)
    assert tracker.rel_tol == 0.05
    assert tracker.value(50) == PLATEAUS_AT[50][0] == 1  # with 0.5 every point would be flat
    tracker.add(60, _val(60, 2.0))
    assert tracker.value(60) == 1


# ---- where= and sort= on every summary field ----------------------------------------------

N_SEEDED = 8


def _summary_for(i: int) -> dict[str, Any]:
    """A different, partly missing, value of every summary metric for trial i."""
    out: dict[str, Any] = {"status": "completed"}
    for k, m in enumerate(SUMMARIES):
        if (i + k) % 5 == 4:
            continue  # missing: the filter must leave it out, the sort put it last
        if m.type == "bool":
            out[m.name] = (i + k) % 2 == 0
        elif m.type == "int":
            out[m.name] = (i * 7 + k) % 11
        else:
            out[m.name] = round(((i * 13 + k * 5) % 17) / 3.0, 6)
    return out


@pytest.fixture(scope="module")
def summaries_study(client: TestClient, engine: Engine) -> tuple[int, list[dict[str, Any]]]:
    sid = create_via_api(client, _spec(name="where-all"))
    data = [_summary_for(i) for i in range(N_SEEDED)]
    with Session(engine) as s:
        for i, summary in enumerate(data):
            cols = {c: summary.get(c) for c in SUMMARY_COLUMNS}
            s.add(Trial(study_id=sid, number=i, state="COMPLETE", summary=summary, **cols))
        s.commit()
    return sid, data


def _numbers(client: TestClient, sid: int, params: Any) -> list[int]:
    r = client.get(f"/v1/studies/{sid}/trials", params=params)
    assert r.status_code == 200, r.text
    return [t["number"] for t in r.json()["items"]]


@pytest.mark.parametrize("name", SUMMARY_NAMES)
def test_where_and_sort_accept_every_summary_field(
    client: TestClient, summaries_study: tuple[int, list[dict[str, Any]]], name: str
) -> None:
    sid, data = summaries_study
    present = [d[name] for d in data if d.get(name) is not None]
    assert len(set(present)) >= 2, "the seed must make this filter discriminate"
    if SUMMARY_BY_NAME[name].type == "bool":
        for flag in (1, 0):
            want = [i for i, d in enumerate(data) if d.get(name) is (flag == 1)]
            assert _numbers(client, sid, {"where": f"{name}={flag}"}) == want
        r = client.get(f"/v1/studies/{sid}/trials", params={"where": f"{name}>=1"})
        assert r.status_code == 422 and r.json()["errors"][0]["field"] == "where"
    else:
        cut = sorted(present)[len(present) // 2]
        for op, fn in ((">=", float.__ge__), ("<", float.__lt__), ("=", float.__eq__)):
            want = [
                i
                for i, d in enumerate(data)
                if d.get(name) is not None and fn(float(d[name]), float(cut))
            ]
            assert _numbers(client, sid, {"where": f"{name}{op}{cut}"}) == want, op
    for desc in (False, True):

        def key(i: int, desc: bool = desc) -> tuple[bool, float, int]:
            v = data[i].get(name)
            x = 0.0 if v is None else float(v)
            return (v is None, -x if desc else x, i)

        want = sorted(range(N_SEEDED), key=key)
        got = _numbers(client, sid, {"sort": f"{'-' if desc else ''}{name}", "limit": 100})
        assert got == want, desc


# ---- the metrics route and metric_rows of cancelled trials ---------------------------------


@pytest.fixture(scope="module")
def trial_with_rows(client: TestClient, engine: Engine) -> tuple[int, int]:
    sid = create_via_api(client, _spec(name="rows"))
    with Session(engine) as s:
        t = Trial(study_id=sid, number=0, state="RUNNING")
        s.add(t)
        s.flush()
        s.add_all(
            Metric(trial_id=t.id, name=n, layer=-1, head=-1, step=step, value=1.0)
            for step in (5, 10, 15)
            for n in ("val_loss", "custom_probe")
        )
        s.commit()
        return sid, t.id


def test_metrics_route_refuses_unknown_names(
    client: TestClient, trial_with_rows: tuple[int, int]
) -> None:
    _, tid = trial_with_rows
    r = client.get(f"/v1/trials/{tid}/metrics", params={"name": ["val_loss", "bogus"]})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["errors"][0]["field"] == "name" and "bogus" in body["message"]
    # a registry name the trial has no rows of is an empty series, not an error
    r = client.get(f"/v1/trials/{tid}/metrics", params={"name": "qk_eig_var"})
    assert r.status_code == 200 and r.json() == []
    # a name outside the registry that the trial did store is served (as the plot route)
    r = client.get(f"/v1/trials/{tid}/metrics", params={"name": "custom_probe"})
    assert r.status_code == 200 and [m["step"] for m in r.json()] == [5, 10, 15]


def test_cancel_counts_the_stored_metric_rows(
    client: TestClient, engine: Engine, trial_with_rows: tuple[int, int]
) -> None:
    sid, tid = trial_with_rows
    assert client.post(f"/v1/studies/{sid}/cancel").json()["status"] == "CANCELLED"
    with Session(engine) as s:
        row = s.get(Trial, tid)
        assert row is not None and row.state == "CANCELLED"
        stored = s.scalar(select(func.count()).where(Metric.trial_id == tid))
        assert row.metric_rows == stored == 6
