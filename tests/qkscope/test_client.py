"""qkscope.Client against the real service (uvicorn on a free port, SQLite and PostgreSQL; no
Ray, so studies stay PENDING). Trials and metric rows are seeded with the ORM into studies
submitted through the client; every expected value comes from the seed table here."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

import qkscope.client
from qkscope import ApiError, Client, ConnectError, Plot, Study, Trial
from qkscope.progress import make_progress
from service.config import Settings
from service.store.models import Metric, utcnow
from service.store.models import Study as StudyRow
from service.store.models import Trial as TrialRow
from tests.conftest import ROOT, free_port
from tests.service.conftest import TOKEN, live_api

SPACE: dict[str, Any] = {
    "regularizer.lambda": {"type": "float", "low": 0.0001, "high": 1.0, "log": True},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
}
# number, state, lambda, norm, value, min_norm_entropy, trapped
SEED: list[tuple[Any, ...]] = [
    (0, "COMPLETE", 0.5, "pre", 2.1, 0.35, False),
    (1, "COMPLETE", 0.002, "post", 1.7, 0.05, True),
    (2, "PRUNED", 0.03, "pre", 2.9, 0.20, False),
    (3, "DIVERGED", 0.9, "pre", None, 0.01, False),
    (4, "COMPLETE", 0.0005, "post", 1.2, 0.12, None),
    (5, "FAILED", 0.1, "pre", None, None, None),
    (6, "COMPLETE", 0.25, "pre", 1.5, 0.02, True),
]


STOP_REASON = "min_norm_entropy_ever 0.0048 < 0.1 at step 50"


def spec(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "budget": {"n_trials": 20}, "search_space": SPACE, **extra}


@pytest.fixture(scope="module")
def url(app_settings: Settings, engine: Engine) -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp, live_api(app_settings, mp) as u:
        yield u


@pytest.fixture(scope="module")
def qk(url: str) -> Iterator[Client]:
    with Client(url, token=TOKEN) as c:
        yield c


@pytest.fixture(scope="module")
def seeded(qk: Client, engine: Engine) -> dict[str, Any]:
    study = qk.submit(spec("client"))
    with Session(engine) as s:
        for n, state, lam, norm, v, mne, trapped in SEED:
            s.add(
                TrialRow(
                    study_id=study.id,
                    number=n,
                    state=state,
                    params={"regularizer.lambda": lam, "model.norm": norm},
                    value=v,
                    values=None if v is None else [v],
                    feasible=None if v is None else True,
                    final_val_loss=v,
                    min_norm_entropy=mne,
                    trapped=trapped,
                    penalty_version=1 if n == 0 else 2,
                    stop_reason=STOP_REASON if state == "PRUNED" else None,
                    started_at=utcnow(),
                )
            )
        s.commit()
        ids = dict(s.execute(select(TrialRow.number, TrialRow.id)).all())
        s.add_all(
            Metric(trial_id=ids[1], name="val_loss", step=st, value=3.0 - st / 100)
            for st in (0, 50, 100)
        )
        s.add_all(
            Metric(
                trial_id=ids[1], name="attn_entropy_norm", layer=0, head=h, step=st, value=h + st
            )
            for h in (0, 1)
            for st in (0, 50)
        )
        s.commit()
    return {"sid": study.id, "ids": ids}


def test_import_loads_no_heavy_stack() -> None:
    code = (
        "import sys, qkscope; from qkscope import Client; Client('http://127.0.0.1:1');"
        "heavy = [m for m in ('torch', 'ray', 'fastapi', 'sqlalchemy', 'starlette', 'optuna',"
        " 'service', 'workers', 'pandas', 'matplotlib') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_submit_dict_yaml_json_and_studyspec(qk: Client, tmp_path: Path) -> None:
    from service.spec import StudySpec

    a = qk.submit(spec("from-dict"))
    assert isinstance(a, Study) and a.name == "from-dict" and a.status == "PENDING"
    assert a.spec["search_space"].keys() == SPACE.keys() and a.created_at is not None
    y = tmp_path / "s.yaml"
    y.write_text(yaml.safe_dump(spec("from-yaml")))
    j = tmp_path / "s.json"
    j.write_text(json.dumps(spec("from-json")))
    assert qk.submit(y).name == "from-yaml"
    assert qk.submit(str(j)).name == "from-json"
    obj = StudySpec.model_validate(spec("from-spec"))
    b = qk.submit(obj)
    assert b.name == "from-spec" and b.n_trials == 20
    again = qk.submit(spec("idem"), idempotency_key="k-1")
    assert qk.submit(spec("idem"), idempotency_key="k-1").id == again.id
    assert qk.study(b.id) == b


def test_errors_name_the_field_and_status(qk: Client, tmp_path: Path) -> None:
    with pytest.raises(ApiError) as e:
        qk.submit({"name": "bad", "budget": {"n_trials": 0}})
    assert e.value.status == 422 and e.value.field == "budget.n_trials"
    assert "budget.n_trials" in str(e.value)
    with pytest.raises(ApiError) as e:
        qk.study(999_999)
    assert e.value.status == 404 and e.value.code == "not_found"
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        qk.submit(tmp_path / "missing.yaml")


def test_token_and_url_come_from_the_cli_environment(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QKSCOPE_API_URL", url)
    monkeypatch.setenv("QKSCOPE_API_TOKEN", TOKEN)
    with Client() as c:
        assert c.url == url and c.studies(limit=1).total >= 0
    with Client(url, token="wrong") as c, pytest.raises(ApiError) as e:
        c.studies()
    assert e.value.status == 401


def test_connect_error_has_a_hint() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with Client(dead) as c, pytest.raises(ConnectError) as e:
        c.studies()
    msg = str(e.value)
    assert dead in msg and "qkscope serve" in msg and "QKSCOPE_API_URL" in msg
    assert "\n" not in msg


def test_trials_filters_sort_and_paging(
    qk: Client, seeded: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = seeded["sid"]
    every = qk.trials(sid)
    assert [t.number for t in every] == [r[0] for r in SEED] and every.total == len(SEED)
    assert all(isinstance(t, Trial) for t in every)
    t1 = every[1]
    assert t1.params == {"regularizer.lambda": 0.002, "model.norm": "post"}
    assert t1.trapped is True and t1.min_norm_entropy == 0.05 and t1.started_at is not None
    assert [t.penalty_version for t in every[:2]] == [1, 2]  # v1 rows keep their label
    done = qk.trials(sid, state="COMPLETE", sort="-value")
    assert [t.number for t in done] == [0, 1, 6, 4]
    two = qk.trials(sid, state=["PRUNED", "DIVERGED"])
    assert [t.number for t in two] == [2, 3]
    low = qk.trials(sid, where=["min_norm_entropy<0.1", "params.regularizer.lambda>0.001"])
    assert sorted(t.number for t in low) == [1, 3, 6]
    page = qk.trials(sid, limit=3, offset=2)
    assert [t.number for t in page] == [2, 3, 4] and page.total == len(SEED)
    monkeypatch.setattr(qkscope.client, "PAGE", 2)  # every page read, none twice
    assert [t.number for t in qk.trials(sid)] == [r[0] for r in SEED]
    with pytest.raises(ApiError) as e:
        qk.trials(sid, where="params.model.norm<1")
    assert e.value.status == 422 and e.value.field == "where"


def test_to_pandas(qk: Client, seeded: dict[str, Any]) -> None:
    pytest.importorskip("pandas")
    df = qk.trials(seeded["sid"]).to_pandas()
    assert list(df.index) == [r[0] for r in SEED]
    assert df.loc[4, "params.regularizer.lambda"] == 0.0005
    assert bool(df.loc[1, "trapped"]) and not bool(df.loc[0, "trapped"])
    assert df["state"].value_counts()["COMPLETE"] == 4
    m = qk.metrics(seeded["ids"][1], name="val_loss").to_pandas()
    assert list(m["step"]) == [0, 50, 100] and list(m["value"]) == [3.0, 2.5, 2.0]


def test_metric_series(qk: Client, seeded: dict[str, Any]) -> None:
    tid = seeded["ids"][1]
    rows = qk.metrics(tid)
    assert rows.values_of("val_loss") == [(0, 3.0), (50, 2.5), (100, 2.0)]
    assert rows.values_of("attn_entropy_norm", layer=0, head=1) == [(0, 1.0), (50, 51.0)]
    trial = qk.trial(tid)
    only = qk.metrics(trial, name="attn_entropy_norm", head=0, step_min=10)
    assert [(p.layer, p.head, p.step, p.value) for p in only] == [(0, 0, 50, 50.0)]


def test_metric_series_pages_transparently(
    qk: Client, seeded: dict[str, Any], engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The /metrics route answers a page at a time (issue 27); the client follows the
    cursor, so a trial with more rows than a page comes back whole and in order."""
    from service.store.ingest import insert_metrics

    tid = seeded["ids"][2]
    with Session(engine) as s:
        insert_metrics(
            s, [{"trial_id": tid, "name": "lr", "step": i, "value": i / 3} for i in range(2_500)]
        )
        s.commit()
    monkeypatch.setattr(qkscope.client, "METRIC_PAGE", 1_000)
    rows = qk.metrics(tid, name="lr")
    assert [(p.step, p.value) for p in rows] == [(i, i / 3) for i in range(2_500)]
    assert qk.metrics(tid) == rows  # the trial's only rows, without a name filter too


def test_best_is_the_lowest_complete_trial(qk: Client, seeded: dict[str, Any]) -> None:
    best = qk.best(seeded["sid"])
    assert [t.number for t in best] == [4] and best[0].value == 1.2
    assert qk.pareto(seeded["sid"]) == best


def test_plot_is_an_inline_png_and_data_is_json(qk: Client, seeded: dict[str, Any]) -> None:
    sid = seeded["sid"]
    p = qk.plot(sid, "scatter", x="params.regularizer.lambda", y="min_norm_entropy", width=640)
    assert isinstance(p, Plot) and p._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert p.size == (640, 600)
    data = qk.plot_data(sid, "history")
    assert data["kind"] == "history"
    with pytest.raises(ApiError) as e:
        qk.plot(sid, "scatter", x="params.nope")
    assert e.value.status == 422 and e.value.field == "x"


def test_export_writes_the_trials_csv(
    qk: Client, seeded: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = qk.export(seeded["sid"])
    assert path == Path(f"study-{seeded['sid']}-trials.csv") and path.exists()
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert [int(r["number"]) for r in rows] == [r[0] for r in SEED]
    named = qk.export(seeded["sid"], tmp_path / "m.parquet", format="parquet", table="metrics")
    assert named.read_bytes()[:4] == b"PAR1"


def test_wait_prints_a_line_only_when_something_changes(qk: Client, engine: Engine) -> None:
    sid = qk.submit(spec("waited")).id

    def finish() -> None:
        time.sleep(1.0)  # several polls see the same PENDING summary
        with Session(engine) as s:
            s.execute(update(StudyRow).where(StudyRow.id == sid).values(status="COMPLETED"))
            s.commit()

    t = threading.Thread(target=finish)
    t.start()
    out = io.StringIO()
    final = qk.wait(sid, poll_s=0.1, file=out)  # StringIO is not a tty: plain lines
    t.join()
    assert final.status == "COMPLETED" and final.done
    lines = out.getvalue().splitlines()
    assert lines == [
        f"study {sid}: PENDING, 0/20 finished, 0 running, best -",
        f"study {sid}: COMPLETED, 0/20 finished, 0 running, best -",
    ]
    assert "\r" not in out.getvalue()


def test_wait_timeout_and_cancel(qk: Client) -> None:
    sid = qk.submit(spec("cancelled")).id
    with pytest.raises(TimeoutError):
        qk.wait(sid, progress=False, poll_s=0.05, timeout_s=0.1)
    assert qk.cancel(sid).status == "CANCELLED"
    assert qk.wait(sid, progress=False).status == "CANCELLED"
    assert [s.id for s in qk.studies(status="CANCELLED")] == [sid]


def test_progress_choice_follows_the_stream() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert type(make_progress(1, True, io.StringIO())).__name__ == "_Lines"
    assert type(make_progress(1, True, Tty())).__name__ == "_Bar"
    assert type(make_progress(1, "lines", Tty())).__name__ == "_Lines"
    assert type(make_progress(1, False, Tty())).__name__ == "_Silent"


def test_a_stopped_trials_reason_reaches_the_client_and_qkscope_results(
    qk: Client, seeded: dict[str, Any]
) -> None:
    """Issue 25: why a trial was stopped (infeasible, or the pruner) is in the client's trial
    and in `qkscope results`, as stored; trials that ran to the end have none."""
    from service.cli import results_table

    reasons = {t.number: t.stop_reason for t in qk.trials(seeded["sid"], limit=50)}
    assert reasons[2] == STOP_REASON
    assert all(r is None for n, r in reasons.items() if n != 2)
    assert qk.trial(seeded["ids"][2]).stop_reason == STOP_REASON
    out = results_table(qk, seeded["sid"])
    assert f"trial 2 stopped: {STOP_REASON}" in out.splitlines()
    assert out.count("stopped:") == 1


def test_lr_sensitivity(qk: Client, engine: Engine) -> None:
    from tests.service.lr_seed import E2E_GRID, expected_group, seed_lr_study

    sid = seed_lr_study(engine, "client-lr-sens")
    res = qk.lr_sensitivity(sid, group_by="model.qk_norm")
    assert res.grid == E2E_GRID and res.group_by == ["model.qk_norm"]
    by_label = {g.label: g for g in res.groups}
    assert set(by_label) == {"model.qk_norm=none", "model.qk_norm=layernorm"}
    for norm in ("none", "layernorm"):
        g, want = by_label[f"model.qk_norm={norm}"], expected_group(norm)
        assert g.sensitivity == pytest.approx(want["mean"])
        assert (g.ci_low, g.ci_high) == pytest.approx((want["lo"], want["hi"]))
        assert [p.lr for p in g.curve] == E2E_GRID
    assert by_label["model.qk_norm=none"].curve[-1].diverged == 3
    # lr 0.1 of "none" ends above l0 on every seed (lr_seed.final_of): drawn at l0
    mid = by_label["model.qk_norm=none"].curve[E2E_GRID.index(0.1)]
    assert mid.above_l0 == 3 and mid.extra == {}
    assert mid.clipped_max is not None and mid.max is not None and mid.clipped_max < mid.max
    assert [o["seed"] for o in by_label["model.qk_norm=none"].left_out] == [3]
    assert qk.lr_sensitivity(sid).groups == res.groups  # default: the one other parameter
    df = res.to_pandas()
    assert list(df["model.qk_norm"]) == [g.params["model.qk_norm"] for g in res.groups]
    with pytest.raises(ApiError) as e:
        qk.lr_sensitivity(sid, group_by=["model.nope"])
    assert e.value.status == 422 and "model.nope" in e.value.message


def test_stability_boundary(qk: Client, engine: Engine) -> None:
    import math

    from tests.service.boundary_seed import GRID, bracket, seed_boundary_study

    sid = seed_boundary_study(engine, "client-boundary")
    res = qk.stability_boundary(sid, target_width=512, tau=0.5)
    assert res.width == "model.d_model" and res.group_by == ["model.qk_norm"]
    assert res.target_width == 512.0 and res.tau == 0.5
    by_label = {g.label: g for g in res.groups}
    none = by_label["model.qk_norm=none"]
    (p,) = [p for p in none.points if (p["width"], p["seed"]) == (128.0, 1)]
    lo, hi = bracket("none", 128, 1, GRID)
    assert p["eta_max"] == pytest.approx(math.sqrt(lo * hi))
    assert none.eta_max_fit["target_width"] == 512.0 and none.holdout is not None
    df = res.to_pandas()
    assert len(df) == sum(len(g.points) for g in res.groups)
    with pytest.raises(ApiError) as e:
        qk.stability_boundary(sid, group_by="model.nope")
    assert e.value.status == 422 and "model.nope" in e.value.message
