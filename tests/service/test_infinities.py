"""An infinite summary number, stored and read back (service/store/nonfinite.py), on real
SQLite and real PostgreSQL.

A running maximum of docs/metrics.md section 9 is +inf once a value overflowed. The trial's
summary goes into a JSON column (PostgreSQL's json rejects Python's `Infinity`) and every
API body is JSON (which has no infinity): the documented form is the string "inf". Written
here through the runner's own path (`judge`, `record_result`), then read through the store,
the results API (one trial, the trial list with its sort and filters, the export) and the
Python client's parsing; the study's other routes must not fail on it (no 500)."""

from __future__ import annotations

import csv
import io
import math
from typing import Any

import optuna
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, Text, cast, select
from sqlalchemy.orm import Session

from qkscope.models import Trial as ClientTrial
from service.runner.results import judge
from service.spec import StudySpec
from service.store import Store, Trial, tell_outcome
from service.store.optuna import optuna_storage, optuna_study_name
from service.store.session import make_sessionmaker
from service.store.trials import ResultRow
from tests.service.conftest import create_via_api
from workers.config import TrialStatus, TrialSummary

INF = math.inf
BOUND = 50.0
# number -> (max_attn_logit_ever, max_abs_output_log_z_ever, qk_eig_var); None: not measured
TRIALS: dict[int, tuple[float | None, float | None, float | None]] = {
    0: (12.0, 0.5, 0.25),
    1: (INF, INF, 0.5),  # overflowed: stopped at the evaluation where it did
    2: (60.0, 2.0, INF),  # qk_eig_var, a Float column, infinite (the columns hold real inf)
    3: (None, None, None),
}
SPACE = {"optim.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True}}


def _summary(n: int) -> TrialSummary:
    logit, log_z, var = TRIALS[n]
    pruned = logit == INF  # 60 > 50 too, but it ran without stop rules: infeasible
    return TrialSummary(
        status=TrialStatus.PRUNED if pruned else TrialStatus.COMPLETED,
        steps_done=20,
        final_val_loss=1.5 if n == 2 else 2.0 + n / 8,  # 2: the best, if infeasible
        qk_eig_var=var,
        max_attn_logit=3.0,
        max_attn_logit_ever=logit,
        max_abs_output_log_z_ever=log_z,
        stop_reason=f"max_attn_logit_ever {logit:.4g} > 50 at step 15" if pruned else None,
        eval_steps=[5, 10, 15, 20],
        val_losses=[3.0, 2.5, 2.2, 2.0],
    )


@pytest.fixture(scope="module")
def seeded(client: TestClient, engine: Engine, module_db_url: str) -> dict[str, Any]:
    """The study and its trials, each ended through the runner's path and told to Optuna
    with its constraint value (the overflowed one's: +inf)."""
    body = {
        "name": "infinities",
        "budget": {"n_trials": 10},
        "search_space": SPACE,
        "constraints": [{"metric": "max_attn_logit_ever", "op": "<=", "value": BOUND}],
    }
    sid = create_via_api(client, body)
    spec = StudySpec.model_validate(body)
    store = Store(make_sessionmaker(engine))
    study = optuna.create_study(
        study_name=optuna_study_name(sid), storage=optuna_storage(module_db_url)
    )
    ids, judged = {}, {}
    for n in TRIALS:
        row_id = store.trials.insert_queued(sid, n, {"optim.lr": 10.0 ** (-n)}, n)
        j = judge(spec, _summary(n), lambda: None)
        judged[n] = j
        result = ResultRow(j.state, j.summary, "node", j.values, j.feasible, 20, None, None, 1.0)
        assert store.trials.record_result(row_id, result)
        ids[n] = row_id
        trial = study.ask()
        tell_outcome(study, trial._trial_id, spec, j.outcome)
    return {"sid": sid, "ids": ids, "judged": judged, "study": study}


def test_the_constraint_value_of_an_overflow_is_inf_and_optuna_keeps_it(
    seeded: dict[str, Any],
) -> None:
    """Optuna takes an infinite constraint value (never NaN): the trial is infeasible."""
    j = seeded["judged"][1]
    assert j.constraints == [INF] and not j.feasible
    assert seeded["judged"][0].constraints == [12.0 - BOUND] and seeded["judged"][0].feasible
    frozen = {t.number: t for t in seeded["study"].get_trials(deepcopy=False)}
    assert frozen[1].system_attrs["constraints:0:max_attn_logit_ever<="] == INF


def test_the_store_keeps_inf_as_the_string_and_reads_it_back_as_the_float(
    seeded: dict[str, Any], engine: Engine
) -> None:
    with Session(engine) as s:
        rows = {
            t.number: t for t in s.scalars(select(Trial).where(Trial.study_id == seeded["sid"]))
        }
        raw = dict(
            s.execute(
                select(Trial.number, cast(Trial.summary["max_attn_logit_ever"], Text)).where(
                    Trial.study_id == seeded["sid"]
                )
            ).all()
        )
    assert raw[1] == '"inf"' and raw[3] == "null"  # in the JSON column: the string
    assert rows[1].summary is not None and rows[1].summary["max_attn_logit_ever"] == INF
    assert rows[1].summary["max_abs_output_log_z_ever"] == INF
    assert rows[1].summary["stop_reason"] == "max_attn_logit_ever inf > 50 at step 15"
    assert rows[0].summary is not None and rows[0].summary["max_attn_logit_ever"] == 12.0
    assert rows[2].qk_eig_var == INF  # a Float column: the real infinity
    assert rows[1].state == "PRUNED" and rows[1].feasible is False
    assert rows[2].state == "COMPLETE" and rows[2].feasible is False


def test_get_trial_says_inf(client: TestClient, seeded: dict[str, Any]) -> None:
    r = client.get(f"/v1/trials/{seeded['ids'][1]}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["summary"]["max_attn_logit_ever"] == "inf"
    assert body["summary"]["max_abs_output_log_z_ever"] == "inf"
    assert body["stop_reason"] == "max_attn_logit_ever inf > 50 at step 15"
    other = client.get(f"/v1/trials/{seeded['ids'][2]}").json()
    assert other["qk_eig_var"] == "inf" and other["summary"]["qk_eig_var"] == "inf"
    assert other["summary"]["max_attn_logit_ever"] == 60.0  # finite numbers stay numbers
    missing = client.get(f"/v1/trials/{seeded['ids'][3]}").json()
    assert missing["summary"]["max_attn_logit_ever"] is None  # not measured: no value
    # the Python client reads the documented form back as floats
    parsed = ClientTrial.from_json(body)
    assert parsed.summary is not None and parsed.summary["max_attn_logit_ever"] == INF
    assert ClientTrial.from_json(other).qk_eig_var == INF


def _numbers(client: TestClient, sid: int, **params: Any) -> list[int]:
    r = client.get(f"/v1/studies/{sid}/trials", params={"limit": 50, **params})
    assert r.status_code == 200, r.text
    return [t["number"] for t in r.json()["items"]]


def test_the_trial_list_sorts_and_filters_inf_as_the_largest_number(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    sid = seeded["sid"]
    assert _numbers(client, sid, sort="max_attn_logit_ever") == [0, 2, 1, 3]  # nulls last
    assert _numbers(client, sid, sort="-max_attn_logit_ever") == [1, 2, 0, 3]
    assert _numbers(client, sid, where=f"max_attn_logit_ever<={BOUND}") == [0]
    assert _numbers(client, sid, where=f"max_attn_logit_ever>{BOUND}") == [1, 2]
    assert _numbers(client, sid, where="max_abs_output_log_z_ever>1e300") == [1]
    # a Float column holding inf
    assert _numbers(client, sid, sort="-qk_eig_var") == [2, 1, 0, 3]
    assert _numbers(client, sid, where="qk_eig_var>1") == [2]
    items = client.get(f"/v1/studies/{sid}/trials", params={"sort": "number"}).json()["items"]
    assert [t["qk_eig_var"] for t in items] == [0.25, 0.5, "inf", None]


def test_the_export_says_inf(client: TestClient, seeded: dict[str, Any]) -> None:
    sid = seeded["sid"]
    r = client.get(f"/v1/studies/{sid}/export", params={"format": "csv"})
    assert r.status_code == 200, r.text
    rows = {int(row["number"]): row for row in csv.DictReader(io.StringIO(r.text))}
    assert rows[1]["max_attn_logit_ever"] == "inf" and rows[2]["qk_eig_var"] == "inf"
    assert rows[0]["max_attn_logit_ever"] == "12.0" and rows[3]["max_attn_logit_ever"] == ""
    r = client.get(f"/v1/studies/{sid}/export", params={"format": "parquet"})
    assert r.status_code == 200, r.text
    table = pq.read_table(io.BytesIO(r.content)).to_pylist()
    by_number = {row["number"]: row for row in table}
    assert by_number[1]["max_attn_logit_ever"] == INF and by_number[2]["qk_eig_var"] == INF


@pytest.mark.parametrize(
    "route",
    [
        "summary",
        "best?feasible_only=false",
        "plots/scatter?x=params.optim.lr&y=max_attn_logit_ever&format=json",
        "plots/scatter?x=params.optim.lr&y=qk_eig_var&format=json",
        "plots/scatter?x=params.optim.lr&y=max_attn_logit_ever&format=png",
        "importance?target=max_attn_logit_ever",
        "lr-sensitivity",
        "stability-boundary",
    ],
)
def test_no_route_of_the_study_fails_on_it(
    client: TestClient, seeded: dict[str, Any], route: str
) -> None:
    r = client.get(f"/v1/studies/{seeded['sid']}/{route}")
    assert r.status_code < 500, r.text
    if route.startswith("best"):
        best = {t["number"]: t for t in r.json()}  # COMPLETE trials: not the pruned one
        assert best[2]["qk_eig_var"] == "inf" and best[2]["summary"]["qk_eig_var"] == "inf"
