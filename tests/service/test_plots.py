"""GET /v1/studies/{id}/plots/{kind} and `qkscope results ID --plot KIND`, on real SQLite and
PostgreSQL databases (no Ray: trials and metric rows are seeded with the ORM into studies made
through the API). Every expected value is computed here from the seed tables, independently of
service/read/plots/; PNGs are checked by their bytes (signature, IHDR size) and decoded with Pillow.
"""

from __future__ import annotations

import io
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.store.models import Metric, Trial
from tests.service.conftest import create_via_api, live_api

KINDS = ("metric", "scatter", "phase", "pareto", "history")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SPACE: dict[str, Any] = {
    "regularizer.lambda": {"type": "float", "low": 0.0001, "high": 1.0, "log": True},
    "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
}

# number, state, lambda, qk_init_std, norm, value, min_norm_entropy, final_rank_ratio,
# entropy_collapse, rank_collapse, trapped, feasible, and the collapse class worked out by hand
# (precedence: diverged, both, entropy, rank, trapped, healthy; unmeasured trials: None).
TRIALS: list[tuple[Any, ...]] = [
    (0, "COMPLETE", 0.5, 0.10, "pre", 2.10, 0.35, 0.40, False, False, False, True, "healthy"),
    (
        1,
        "COMPLETE",
        0.002,
        0.50,
        "post",
        1.70,
        0.05,
        0.30,
        True,
        False,
        True,
        True,
        "entropy_collapse",
    ),
    (2, "PRUNED", 0.03, 0.20, "pre", 2.90, 0.20, 0.01, False, True, False, None, "rank_collapse"),
    (3, "DIVERGED", 0.9, 1.20, "pre", None, 0.01, 0.00, True, True, False, None, "diverged"),
    (4, "COMPLETE", 0.0005, 0.05, "post", 1.20, 0.12, 0.20, False, False, False, False, "healthy"),
    (5, "FAILED", 0.1, 0.30, "pre", None, None, None, None, None, None, None, None),
    (6, "RUNNING", 0.007, 0.40, "post", None, None, None, None, None, None, None, None),
    (7, "COMPLETE", 0.25, 0.30, "pre", 1.50, 0.02, 0.02, True, True, False, True, "both"),
    (8, "COMPLETE", 0.0001, 0.80, "post", 1.90, 0.30, 0.25, False, False, True, True, "trapped"),
    (9, "COMPLETE", 0.04, 0.02, "pre", 1.65, 0.25, 0.35, False, False, False, True, "healthy"),
    (10, "COMPLETE", 0.009, 0.90, "post", 1.95, 0.28, 0.33, False, False, False, True, "healthy"),
    (11, "COMPLETE", 0.3, 0.06, "pre", 2.40, 0.40, 0.45, False, False, False, True, "healthy"),
]
KEYS = ("number", "state", "lam", "std", "norm", "value", "mne", "frr", "ec", "rc", "trapped",
        "feasible", "cls")  # fmt: skip
MEASURED = ("COMPLETE", "PRUNED", "DIVERGED")
METRIC_TRIALS = (0, 7, 9, 11)
STEPS = (0, 50, 100, 150)


def spec(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "budget": {"n_trials": 20}, "search_space": SPACE, **extra}


def metric_value(number: int, name: str, layer: int, head: int, step: int) -> float:
    """A distinct value for every metric row, so any mix-up shows."""
    return round(3.0 - step / 100 + number / 10 + layer / 100 + head / 1000, 6)


def metric_rows(number: int) -> list[tuple[str, int, int, int, float]]:
    rows = []
    for step in STEPS:
        rows.append(("val_loss", -1, -1, step, metric_value(number, "val_loss", -1, -1, step)))
        for layer in (0, 1, 2):
            rows.append(
                ("rank_ratio", layer, -1, step, metric_value(number, "rr", layer, -1, step))
            )
        for layer in (0, 1):
            for head in (0, 1):
                v = metric_value(number, "attn_entropy_norm", layer, head, step)
                rows.append(("attn_entropy_norm", layer, head, step, v))
    return rows


def assert_error(r: Any, status: int, field: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error", "message", "errors"} and body["message"], body
    if field is not None:
        assert [e["field"] for e in body["errors"]] == [field], body
    return dict(body)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE, data[:16]
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def assert_drawn_png(data: bytes, size: tuple[int, int]) -> None:
    from PIL import Image

    assert png_size(data) == size
    img = Image.open(io.BytesIO(data))
    img.load()
    assert img.format == "PNG" and img.size == size
    colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # axes, text and marks, not a blank canvas


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded(client: TestClient, engine: Engine) -> dict[str, Any]:
    sid = create_via_api(client, spec("plots"))
    data = [dict(zip(KEYS, t, strict=True)) for t in TRIALS]
    with Session(engine) as s:
        for d in data:
            v = d["value"]
            s.add(
                Trial(
                    study_id=sid,
                    number=d["number"],
                    state=d["state"],
                    params={
                        "regularizer.lambda": d["lam"],
                        "model.qk_init_std": d["std"],
                        "model.norm": d["norm"],
                    },
                    value=v,
                    values=None if v is None else [v],
                    feasible=d["feasible"],
                    final_val_loss=v,
                    min_norm_entropy=d["mne"],
                    final_rank_ratio=d["frr"],
                    entropy_collapse=d["ec"],
                    rank_collapse=d["rc"],
                    trapped=d["trapped"],
                    summary=None
                    if d["state"] in ("FAILED", "RUNNING")
                    else {
                        "status": {"DIVERGED": "diverged", "PRUNED": "pruned"}.get(
                            d["state"], "completed"
                        ),
                        "qk_eig_mean": d["number"] / 100,
                        "plateau_count": d["number"] % 3,
                    },
                )
            )
        s.commit()
        ids = dict(s.execute(select(Trial.number, Trial.id).where(Trial.study_id == sid)).all())
        for n in METRIC_TRIALS:
            s.add_all(
                Metric(trial_id=ids[n], name=name, layer=la, head=h, step=st, value=val)
                for name, la, h, st, val in metric_rows(n)
            )
        s.commit()
    return {"sid": sid, "trials": data, "ids": ids}


def get_json(client: TestClient, sid: int, kind: str, **params: Any) -> dict[str, Any]:
    r = client.get(f"/v1/studies/{sid}/plots/{kind}", params={**params, "format": "json"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    return dict(r.json())


# --- PNG --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_a_png_of_the_requested_size(
    client: TestClient, seeded: dict[str, Any], kind: str
) -> None:
    url = f"/v1/studies/{seeded['sid']}/plots/{kind}"
    r = client.get(url)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert f"study-{seeded['sid']}-{kind}.png" in r.headers["content-disposition"]
    assert_drawn_png(r.content, (900, 600))
    r = client.get(url, params={"width": 640, "height": 480})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert_drawn_png(r.content, (640, 480))


@pytest.mark.parametrize(
    "params",
    [
        {"x": "params.model.norm", "y": "min_norm_entropy", "color": "collapse_class"},
        {"x": "params.regularizer.lambda", "y": "value", "color": "min_norm_entropy"},
        {"x": "final_rank_ratio", "y": "qk_eig_mean", "color": "none"},
    ],
)
def test_scatter_png_with_categorical_numeric_and_no_colour(
    client: TestClient, seeded: dict[str, Any], params: dict[str, str]
) -> None:
    r = client.get(f"/v1/studies/{seeded['sid']}/plots/scatter", params=params)
    assert r.status_code == 200, r.text
    assert_drawn_png(r.content, (900, 600))


def test_accept_header_chooses_json_and_format_wins(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    url = f"/v1/studies/{seeded['sid']}/plots/history"
    as_json = client.get(url, headers={"Accept": "application/json"})
    assert as_json.headers["content-type"].startswith("application/json")
    assert as_json.json()["kind"] == "history"
    assert as_json.json() == get_json(client, seeded["sid"], "history")
    png = client.get(url, headers={"Accept": "image/png,application/json;q=0.5"})
    assert png.headers["content-type"] == "image/png"
    forced = client.get(url, params={"format": "png"}, headers={"Accept": "application/json"})
    assert forced.headers["content-type"] == "image/png" and forced.content[:8] == PNG_SIGNATURE


# --- the data of each kind, against the seed ---------------------------------------------------


def test_metric_series_for_chosen_trials(client: TestClient, seeded: dict[str, Any]) -> None:
    sid, ids = seeded["sid"], seeded["ids"]
    got = get_json(client, sid, "metric", metric="val_loss", trials="9,0")
    assert got["trials"] == [9, 0] and got["metric"] == "val_loss"
    assert [(s["trial"], s["trial_id"], s["layer"], s["head"]) for s in got["series"]] == [
        (9, ids[9], None, None),
        (0, ids[0], None, None),
    ]
    for s in got["series"]:
        assert s["steps"] == list(STEPS)
        expected = [metric_value(s["trial"], "val_loss", -1, -1, st) for st in STEPS]
        assert s["values"] == pytest.approx(expected)

    one = get_json(client, sid, "metric", metric="attn_entropy_norm", trials="7", layer=1, head=0)
    assert [(s["trial"], s["layer"], s["head"]) for s in one["series"]] == [(7, 1, 0)]
    expected = [metric_value(7, "attn_entropy_norm", 1, 0, st) for st in STEPS]
    assert one["series"][0]["values"] == pytest.approx(expected)

    every = get_json(client, sid, "metric", metric="attn_entropy_norm", trials="7,11")
    assert [(s["trial"], s["layer"], s["head"]) for s in every["series"]] == [
        (n, la, h) for n in (7, 11) for la in (0, 1) for h in (0, 1)
    ]
    layer = get_json(client, sid, "metric", metric="rank_ratio", trials="0", layer=2)
    assert [(s["layer"], s["head"]) for s in layer["series"]] == [(2, None)]
    assert layer["series"][0]["values"] == pytest.approx(
        [metric_value(0, "rr", 2, -1, st) for st in STEPS]
    )
    # A trial without metric rows is listed but has no series.
    quiet = get_json(client, sid, "metric", trials="1,7")
    assert quiet["trials"] == [1, 7] and [s["trial"] for s in quiet["series"]] == [7]


def test_metric_default_trials_are_the_best_few_feasible(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    ok = [d for d in seeded["trials"] if d["state"] == "COMPLETE" and d["feasible"] is not False]
    best = [d["number"] for d in sorted(ok, key=lambda d: (d["value"], d["number"]))[:5]]
    got = get_json(client, seeded["sid"], "metric")
    assert got["trials"] == best == [7, 9, 1, 8, 10]
    assert got["metric"] == "val_loss"
    assert [s["trial"] for s in got["series"]] == [n for n in best if n in METRIC_TRIALS]


def test_metric_default_trials_of_a_study_without_complete_trials_are_the_latest(
    client: TestClient, engine: Engine
) -> None:
    sid = create_via_api(client, spec("running-only"))
    with Session(engine) as s:
        s.add_all(Trial(study_id=sid, number=n, state="RUNNING", params={}) for n in range(8))
        s.commit()
    assert get_json(client, sid, "metric")["trials"] == [3, 4, 5, 6, 7]


def test_scatter_points_match_the_seed(client: TestClient, seeded: dict[str, Any]) -> None:
    got = get_json(
        client, seeded["sid"], "scatter", x="params.regularizer.lambda", y="final_val_loss",
        color="min_norm_entropy",
    )  # fmt: skip
    expected = [
        {
            "trial": d["number"],
            "state": d["state"],
            "x": d["lam"],
            "y": d["value"],
            "color": d["mne"],
        }
        for d in seeded["trials"]
        if d["state"] in MEASURED and d["value"] is not None
    ]
    assert got["points"] == expected
    assert got["x_log"] is True and got["y_log"] is False
    # Defaults: x = first parameter, y = the objective's metric, colour = second parameter.
    dflt = get_json(client, seeded["sid"], "scatter")
    assert (dflt["x"], dflt["y"], dflt["color"]) == (
        "params.regularizer.lambda",
        "final_val_loss",
        "params.model.qk_init_std",
    )
    assert [p["color"] for p in dflt["points"]] == [
        d["std"] for d in seeded["trials"] if d["state"] in MEASURED and d["value"] is not None
    ]
    # Summary fields that live only in the JSON summary, and categorical parameters.
    cat = get_json(
        client, seeded["sid"], "scatter", x="params.model.norm", y="qk_eig_mean", color="state"
    )
    assert [(p["trial"], p["x"], p["y"], p["color"]) for p in cat["points"]] == [
        (d["number"], d["norm"], d["number"] / 100, d["state"])
        for d in seeded["trials"]
        if d["state"] in MEASURED
    ]


def test_phase_classes_match_the_hand_worked_table(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    got = get_json(client, seeded["sid"], "phase")
    assert (got["x"], got["y"]) == ("params.regularizer.lambda", "params.model.qk_init_std")
    assert got["classes"] == [
        "healthy", "entropy_collapse", "rank_collapse", "both", "diverged", "trapped",
    ]  # fmt: skip
    expected = [
        {"trial": d["number"], "state": d["state"], "x": d["lam"], "y": d["std"], "class": d["cls"]}
        for d in seeded["trials"]
        if d["cls"] is not None
    ]
    assert got["points"] == expected
    counts = {c: sum(1 for d in seeded["trials"] if d["cls"] == c) for c in got["classes"]}
    assert got["counts"] == counts and all(v >= 1 for v in counts.values())
    flipped = get_json(client, seeded["sid"], "phase", x="params.model.norm", y="min_norm_entropy")
    assert [(p["x"], p["y"], p["class"]) for p in flipped["points"]] == [
        (d["norm"], d["mne"], d["cls"]) for d in seeded["trials"] if d["cls"] is not None
    ]


def test_history_running_best_counts_complete_feasible_trials_only(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    got = get_json(client, seeded["sid"], "history")
    with_value = [d for d in seeded["trials"] if d["value"] is not None]
    assert [(p["trial"], p["state"], p["value"], p["feasible"]) for p in got["points"]] == [
        (d["number"], d["state"], d["value"], d["feasible"]) for d in with_value
    ]
    best, running = [], None
    for d in with_value:
        if d["state"] == "COMPLETE" and d["feasible"] is not False:
            running = d["value"] if running is None else min(running, d["value"])
            best.append({"trial": d["number"], "value": running})
    assert got["best"] == best
    assert best[-1]["value"] == 1.5  # trial 4 (1.2) is infeasible, trial 2 was pruned
    assert got["objective"] == {"metric": "final_val_loss", "direction": "minimize"}
    # l0, the web UI's loss-axis ceiling: the largest val_loss at a trial's first evaluated
    # step, over the trials with metric rows (written here, read back through the route)
    first = min(STEPS)
    want = max(metric_value(n, "val_loss", -1, -1, first) for n in METRIC_TRIALS)
    assert got["l0"] == pytest.approx(want)
    assert got["l0"] != pytest.approx(metric_value(0, "val_loss", -1, -1, first))  # the max


def test_pareto_of_one_objective_ranks_trials_and_agrees_with_best(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    sid = seeded["sid"]
    got = get_json(client, sid, "pareto")
    complete = [d for d in seeded["trials"] if d["state"] == "COMPLETE"]
    ranked = sorted(complete, key=lambda d: (d["value"], d["number"]))
    assert [(p["rank"], p["trial"], p["values"]) for p in got["points"]] == [
        (i + 1, d["number"], [d["value"]]) for i, d in enumerate(ranked)
    ]
    best = client.get(f"/v1/studies/{sid}/best").json()
    assert got["front"] == [t["number"] for t in best] == [7]
    assert [p["trial"] for p in got["points"] if p["on_front"]] == [7]
    anyf = get_json(client, sid, "pareto", feasible_only="false")
    assert anyf["front"] == [4]


def test_pareto_of_two_objectives_is_the_brute_force_front(
    client: TestClient, engine: Engine
) -> None:
    body = spec(
        "pareto2",
        objectives=[
            {"metric": "final_val_loss", "direction": "minimize"},
            {"metric": "min_norm_entropy", "direction": "maximize"},
        ],
    )
    sid = create_via_api(client, body)
    rng = random.Random(7)
    rows = []
    for n in range(30):
        vals = [rng.choice([1.0, 1.5, 2.0, 2.5]), rng.choice([0.1, 0.2, 0.3, 0.4])]
        state = "COMPLETE" if n < 24 else rng.choice(["PRUNED", "FAILED", "RUNNING"])
        rows.append((n, state, vals, n % 5 != 0))
    with Session(engine) as s:
        s.add_all(
            Trial(study_id=sid, number=n, state=st, params={}, values=v, value=v[0], feasible=f)
            for n, st, v, f in rows
        )
        s.commit()

    def front(feasible_only: bool) -> list[int]:
        pts = {
            n: (v[0], v[1]) for n, st, v, f in rows if st == "COMPLETE" and (f or not feasible_only)
        }

        def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
            return a[0] <= b[0] and a[1] >= b[1] and a != b

        return sorted(n for n, p in pts.items() if not any(dominates(q, p) for q in pts.values()))

    for feasible_only in (True, False):
        got = get_json(client, sid, "pareto", feasible_only=str(feasible_only).lower())
        assert got["front"] == front(feasible_only)
        assert got["x_objective"] == 0 and got["y_objective"] == 1
        assert {p["trial"] for p in got["points"]} == {
            n for n, st, _, _ in rows if st == "COMPLETE"
        }
        assert {p["trial"] for p in got["points"] if p["on_front"]} == set(front(feasible_only))
        best = client.get(f"/v1/studies/{sid}/best", params={"feasible_only": feasible_only}).json()
        assert sorted(t["number"] for t in best) == front(feasible_only)
    swapped = get_json(client, sid, "pareto", x="min_norm_entropy", y="final_val_loss")
    assert (swapped["x_objective"], swapped["y_objective"]) == (1, 0)
    r = client.get(f"/v1/studies/{sid}/plots/pareto")
    assert_drawn_png(r.content, (900, 600))
    hist = get_json(client, sid, "history", objective=1)
    assert hist["objective"] == {"metric": "min_norm_entropy", "direction": "maximize"}
    expected_best, running = [], None
    for n, st, v, f in rows:
        if st == "COMPLETE" and f:
            running = v[1] if running is None else max(running, v[1])
            expected_best.append({"trial": n, "value": running})
    assert hist["best"] == expected_best


def test_empty_study_plots_say_no_data(client: TestClient) -> None:
    sid = create_via_api(client, spec("empty"))
    for kind in KINDS:
        r = client.get(f"/v1/studies/{sid}/plots/{kind}")
        assert r.status_code == 200, (kind, r.text)
        assert_drawn_png(r.content, (900, 600))
        data = get_json(client, sid, kind)
        assert data.get("series", data.get("points")) == []


# --- errors and auth ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "params", "field"),
    [
        ("bogus", {}, "kind"),
        ("metric", {"metric": "no such"}, "metric"),
        ("metric", {"metric": "made_up_metric"}, "metric"),
        ("metric", {"trials": "abc"}, "trials"),
        ("metric", {"trials": ","}, "trials"),
        ("metric", {"trials": "0,999"}, "trials"),
        ("metric", {"trials": "²"}, "trials"),
        ("metric", {"trials": "1234567890"}, "trials"),
        ("metric", {"trials": ",".join(map(str, range(25)))}, "trials"),
        ("metric", {"metric": "val_loss", "layer": 1}, "layer"),
        ("metric", {"metric": "rank_ratio", "head": 0}, "head"),
        ("metric", {"layer": -1}, "layer"),
        ("scatter", {"x": "params.nope"}, "x"),
        ("scatter", {"x": "colour"}, "x"),
        ("scatter", {"y": "params.model.norm"}, "y"),
        ("scatter", {"y": "state"}, "y"),
        ("scatter", {"color": "params.nope"}, "color"),
        ("phase", {"y": "params.model.nope"}, "y"),
        ("pareto", {"x": "final_val_loss"}, None),  # one objective: x/y are not used
        ("history", {"objective": 1}, "objective"),
        ("history", {"objective": -1}, "objective"),
        ("history", {"width": 10}, "width"),
        ("history", {"height": 5000}, "height"),
        ("history", {"format": "svg"}, "format"),
    ],
)
def test_bad_kind_or_parameter_is_422_naming_it(
    client: TestClient, seeded: dict[str, Any], kind: str, params: dict[str, Any], field: str | None
) -> None:
    r = client.get(f"/v1/studies/{seeded['sid']}/plots/{kind}", params=params)
    if field is None:
        assert r.status_code == 200
        return
    body = assert_error(r, 422, field)
    assert body["error"] == "validation_error"


def test_pareto_axis_must_be_an_objective(client: TestClient, engine: Engine) -> None:
    sid = create_via_api(
        client,
        spec(
            "pareto-axes",
            objectives=[{"metric": "final_val_loss"}, {"metric": "qk_eig_var"}],
        ),
    )
    assert_error(client.get(f"/v1/studies/{sid}/plots/pareto", params={"x": "nope"}), 422, "x")


def test_phase_needs_two_axes_without_a_two_parameter_space(client: TestClient) -> None:
    sid = create_via_api(client, {"name": "no-space", "budget": {"n_trials": 2}})
    assert_error(client.get(f"/v1/studies/{sid}/plots/phase"), 422, "x")
    assert_error(client.get(f"/v1/studies/{sid}/plots/scatter"), 422, "x")
    ok = client.get(
        f"/v1/studies/{sid}/plots/phase", params={"x": "final_rank_ratio", "y": "min_norm_entropy"}
    )
    assert ok.status_code == 200 and ok.content[:8] == PNG_SIGNATURE


def test_unknown_study_is_404(client: TestClient) -> None:
    for kind in KINDS:
        body = assert_error(client.get(f"/v1/studies/987654/plots/{kind}"), 404)
        assert body["error"] == "not_found" and "987654" in body["message"]
    assert_error(client.get("/v1/studies/0/plots/history"), 422, "study_id")


def test_plots_need_the_token(client: TestClient, seeded: dict[str, Any]) -> None:
    for kind in KINDS:
        url = f"/v1/studies/{seeded['sid']}/plots/{kind}"
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            r = client.get(url, headers=headers)
            body = assert_error(r, 401)
            assert body["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
            r = client.get(url, params={"format": "json"}, headers=headers)
            assert r.status_code == 401


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_results_plot_writes_the_apis_png(
    client: TestClient,
    seeded: dict[str, Any],
    app_settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from service import cli
    from service.read.plots import PLOT_KINDS

    assert cli.PLOT_KINDS == PLOT_KINDS  # the CLI's copy of the list
    sid = seeded["sid"]
    monkeypatch.chdir(tmp_path)
    with live_api(app_settings, monkeypatch):
        assert cli.main(["results", str(sid), "--plot", "history"]) == 0
        default = tmp_path / f"study-{sid}-history.png"
        assert_drawn_png(default.read_bytes(), (900, 600))
        out = tmp_path / "phase.png"
        argv = ["results", str(sid), "--plot", "metric", "--out", str(out), "--metric",
                "attn_entropy_norm", "--trials", "7,11", "--layer", "1", "--head", "0"]  # fmt: skip
        assert cli.main(argv) == 0
        assert_drawn_png(out.read_bytes(), (900, 600))
        capsys.readouterr()
        assert cli.main([*argv[:4], "--json", *argv[6:]]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed == get_json(
            client, sid, "metric", metric="attn_entropy_norm", trials="7,11", layer=1, head=0
        )
        # An API error is printed with its field and exits 1, writing nothing.
        bad = tmp_path / "bad.png"
        code = cli.main(
            ["results", str(sid), "--plot", "scatter", "--x", "params.nope", "--out", str(bad)]
        )
        assert code == 1 and not bad.exists()
        err = capsys.readouterr().err
        assert "x: " in err and len(err.splitlines()) == 1  # one line, printed once
        monkeypatch.setenv("QKSCOPE_API_TOKEN", "wrong")
        assert cli.main(["results", str(sid), "--plot", "history", "--out", str(bad)]) == 1
        assert not bad.exists()
