"""On a real local Ray head and a real database: the runner prunes on a plateau metric
(Optuna gets the intermediate values the registry defines, from real reports); then the
study is cancelled while its trials train (the suite's one cancel of a running study): its
job stops, no trial is left open in our table or Optuna's, and every cancelled trial keeps
the count of the metric rows it stored."""

from __future__ import annotations

import time
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.store.models import Metric, Trial
from service.store.optuna import optuna_study_name
from service.store.session import make_engine, make_sessionmaker, normalize_url
from tests.service.helpers import small_quickstart, wait_for
from workers import metrics as M

pytestmark = pytest.mark.cluster


def _val_curve(client: TestClient, trial_id: int) -> dict[int, float]:
    r = client.get(f"/v1/trials/{trial_id}/metrics", params={"name": "val_loss"})
    assert r.status_code == 200, r.text
    return {m["step"]: m["value"] for m in r.json()}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: the store's contract
def test_pruning_on_plateau_steps_then_a_cancel_leaves_nothing_open(
    app_client: TestClient, ray_head: LocalRayHead, db_url: str
) -> None:
    client = app_client
    spec: dict[str, Any] = small_quickstart(n_trials=4, steps=5000)
    spec["base"] |= {"eval_every": 10, "plateau_window": 1, "plateau_rel_tol": 0.05}
    spec["objectives"] = [{"metric": "longest_plateau", "direction": "minimize"}]
    spec["constraints"] = []
    spec["pruner"] = {"kind": "median", "n_startup_trials": 1, "n_warmup_steps": 0}
    r = client.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid, job_id = r.json()["id"], r.json()["ray_job_id"]

    # Wait until Optuna holds >= 3 intermediate values of a running trial.
    storage = optuna.storages.RDBStorage(normalize_url(db_url))
    deadline = time.monotonic() + 240
    reported: dict[int, float] = {}
    number = -1
    while time.monotonic() < deadline and len(reported) < 3:
        time.sleep(1.0)
        try:
            study = optuna.load_study(study_name=optuna_study_name(sid), storage=storage)
        except KeyError:
            continue
        for ft in study.get_trials(deepcopy=False):
            if len(ft.intermediate_values) >= 3:
                number, reported = ft.number, dict(ft.intermediate_values)
                break
    assert len(reported) >= 3, "no trial reported 3 intermediate values"

    # They are longest_plateau of the stored validation-loss curve up to each step.
    page = client.get(f"/v1/studies/{sid}/trials", params={"where": f"number={number}"}).json()
    curve = _val_curve(client, page["items"][0]["id"])
    for step, value in reported.items():
        steps = sorted(s for s in curve if 1 <= s <= step)
        plateaus = M.detect_plateaus(steps, [curve[s] for s in steps], 1, 0.05)
        assert value == M.plateau_stats(plateaus, step)["longest_plateau"], step

    # Cancel: every cancelled trial's metric_rows is the number of rows it stored.
    assert client.post(f"/v1/studies/{sid}/cancel").json()["status"] == "CANCELLED"
    launcher = JobLauncher(ray_head.dashboard_url)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and launcher.status(job_id) not in (
        "STOPPED",
        "FAILED",
        "SUCCEEDED",
    ):
        time.sleep(0.5)
    assert launcher.status(job_id) in ("STOPPED", "FAILED", "SUCCEEDED")
    wait_for(client, sid, {"CANCELLED"}, timeout=10)
    # Nothing open in either store (the runner may still be closing when the API answers).
    deadline = time.monotonic() + 60
    while True:
        items = client.get(f"/v1/studies/{sid}/trials", params={"limit": 100}).json()["items"]
        ours = {t["number"]: t["state"] for t in items}
        study = optuna.load_study(study_name=optuna_study_name(sid), storage=storage)
        theirs = {t.number: t.state for t in study.get_trials(deepcopy=False)}
        open_ = {"QUEUED", "RUNNING"} & set(ours.values())
        if (not open_ and optuna.trial.TrialState.RUNNING not in theirs.values()) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    storage.engine.dispose()
    assert "CANCELLED" in ours.values() and not {"QUEUED", "RUNNING"} & set(ours.values()), ours
    assert set(theirs) == set(ours)
    for n, state in ours.items():  # a cancelled trial is a failed one to Optuna
        want = {"CANCELLED": "FAIL", "COMPLETE": "COMPLETE", "PRUNED": "PRUNED"}[state]
        assert theirs[n].name == want, (n, state, theirs[n])
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            rows = s.execute(
                select(Trial.id, Trial.state, Trial.metric_rows).where(Trial.study_id == sid)
            ).all()
            stored = dict(
                s.execute(
                    select(Metric.trial_id, func.count())
                    .where(Metric.trial_id.in_([r.id for r in rows]))
                    .group_by(Metric.trial_id)
                ).all()
            )
    finally:
        engine.dispose()
    cancelled = [r for r in rows if r.state == "CANCELLED"]
    assert cancelled and any(stored.get(r.id, 0) > 0 for r in cancelled)
    for r in cancelled:
        assert r.metric_rows == stored.get(r.id, 0), r
