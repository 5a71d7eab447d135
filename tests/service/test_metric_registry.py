"""Everything the service derives from the metric registry, checked against the real thing:
the ORM columns, the spec's metric names, pruning's intermediate values (against real trial
summaries), `where=`/`sort=` on every summary field (SQLite and PostgreSQL), the metric
route's names, export and plot fields, and `metric_rows` of cancelled trials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import Boolean, Engine, Float, Integer, func, select
from sqlalchemy.orm import Session

from service.api.schemas import TrialOut
from service.read.export import trial_columns
from service.read.plots.common import FLAG_FIELDS, KNOWN_METRICS, NUMERIC_FIELDS
from service.read.queries import SORTABLE
from service.spec import StudySpec
from service.store.models import SUMMARY_COLUMNS, Metric, Study, Trial
from tests.service.conftest import create_via_api
from tests.workers.helpers import Recorder, tiny
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
from workers.trial import TrialSummary, run_trial

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


# ---- intermediate values for pruning (computed by the worker) ------------------------------

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


@pytest.fixture(scope="module")
def short_and_long() -> tuple[TrialSummary, TrialSummary]:
    """The same trial run for 20 and for 40 steps, with no objective (no values reported)."""
    short = run_trial(tiny(steps=20, **PLATEAU_TRIAL))
    long = run_trial(tiny(steps=40, **PLATEAU_TRIAL))
    assert long.longest_plateau > 0  # the plateau metrics are exercised, not all zero
    return short, long


@pytest.mark.parametrize("metric", INTERMEDIATE_SUMMARIES)
def test_reported_values_are_the_summary_had_the_trial_stopped_there(
    metric: str, short_and_long: tuple[TrialSummary, TrialSummary]
) -> None:
    """What a worker sends with each evaluation, and the runner hands Optuna's pruner: at
    step k it equals the summary of the same trial run for k steps only (an independent run
    that reported nothing)."""
    rec = Recorder()
    run_trial(tiny(steps=40, **PLATEAU_TRIAL), rec, objective=metric)
    assert rec.steps == [5, 10, 15, 20, 25, 30, 35, 40]
    assert all(rec.values[step] is not None for step in rec.steps), rec.values
    for stop, summary in zip((20, 40), short_and_long, strict=True):
        want = _summary_value(summary, metric)
        assert want is not None, metric
        assert rec.values[stop] == pytest.approx(want, rel=1e-9, abs=1e-12), (metric, stop)


def test_without_an_objective_reports_carry_no_value() -> None:
    rec = Recorder()
    run_trial(tiny(steps=10, eval_at_init=True, **PLATEAU_TRIAL), rec)
    assert rec.steps == [0, 5, 10] and set(rec.values.values()) == {None}


def test_step_zero_carries_no_value() -> None:
    """The untrained model: nothing trained to judge, so nothing for the pruner."""
    rec = Recorder()
    run_trial(tiny(steps=10, eval_at_init=True, **PLATEAU_TRIAL), rec, objective="best_val_loss")
    assert rec.values[0] is None and rec.values[5] is not None and rec.values[10] is not None


def test_best_value_is_a_running_minimum() -> None:
    """best_val_loss reported at each step is the minimum of the val_loss reported so far
    (read from the same reports: an independent reduction)."""
    rec = Recorder()
    run_trial(
        tiny(steps=40, **{**PLATEAU_TRIAL, "optim": {"lr": 0.05}}), rec, objective="best_val_loss"
    )
    seen: list[float] = []
    for step, points in rec.reports:
        seen.append(next(p.value for p in points if p.name == "val_loss"))
        assert rec.values[step] == pytest.approx(min(seen)), step


def test_non_intermediate_metrics_are_refused() -> None:
    for name in set(SUMMARY_NAMES) - set(INTERMEDIATE_SUMMARIES):
        with pytest.raises(ValueError, match="no intermediate value"):
            run_trial(tiny(steps=5), Recorder(), objective=name)


def test_a_resumed_trial_reports_the_values_of_an_uninterrupted_one(tmp_path: Path) -> None:
    """What a runner that meets a trial already under way relies on: the worker resumes the
    trial's history from its checkpoint, so the values after the resume are those of a run
    never interrupted, the plateau counts (which need the whole curve) included; the trial's
    own `plateau_rel_tol` is used (0.05 here, not the default)."""
    over = {**PLATEAU_TRIAL, "plateau_rel_tol": 0.05}
    straight = Recorder()
    run_trial(
        tiny(steps=40, **over, checkpoint={"dir": str(tmp_path / "a")}),
        straight,
        objective="longest_plateau",
    )
    cfg = tiny(steps=40, **over, checkpoint={"dir": str(tmp_path / "b")})
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_trial(cfg, Recorder(crash_at_step=25), objective="longest_plateau")
    resumed = Recorder()
    run_trial(cfg, resumed, objective="longest_plateau")
    assert resumed.steps == [25, 30, 35, 40]  # from the checkpoint after step 20
    assert {s: resumed.values[s] for s in resumed.steps} == {
        s: straight.values[s] for s in resumed.steps
    }
    assert any(straight.values[s] for s in resumed.steps)  # a plateau, not all zero


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
