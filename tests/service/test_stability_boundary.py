"""The stability boundary across widths (METRICS.md section 11): the computation against
independent ones (numpy least squares and parabola, scipy's t quantile, the boundary known
from how the made-up trials were generated), then through GET
/v1/studies/{id}/stability-boundary on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from scipy import stats
from sqlalchemy import Engine

from service.read.stability_boundary import (
    Run,
    boundary_point,
    fit_power_law,
    group_boundary,
    holdout_check,
)
from tests.service.boundary_seed import (
    BISECT,
    bisect_lr,
    boundary_spec,
    bracket,
    l0_of,
    seed_boundary_study,
)
from tests.service.boundary_seed import GRID as B_GRID
from tests.service.boundary_seed import SEEDS as B_SEEDS
from tests.service.boundary_seed import WIDTHS as B_WIDTHS
from tests.service.conftest import create_via_api

GRID = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]


def runs(losses: list[float | None], l0: float = 5.0, grid: list[float] = GRID) -> list[Run]:
    """One run per learning rate; None: diverged."""
    return [Run(e, v, v is None, False, l0) for e, v in zip(grid, losses, strict=True)]


# --- one width and seed --------------------------------------------------------------------------


def test_eta_max_walks_up_from_the_best_learning_rate() -> None:
    # 1e-4 barely trains (4.9 > l* + 0.5 (l0 - l*) = 3.5): too small, not an instability
    p = boundary_point(64, 0, runs([4.9, 2.5, 2.0, 3.0, None]))
    assert (p.l0, p.l_star, p.eta_star) == (5.0, 2.0, 1e-2)
    assert p.unstable == [1e-4, 1.0]
    assert (p.eta_s, p.eta_u) == (1e-1, 1.0)
    assert p.eta_max == pytest.approx(math.sqrt(1e-1 * 1.0))
    assert p.ratio == pytest.approx(10.0) and p.reason is None
    # the tau rule alone: 3.6 > 3.5 is unstable though finite, so the boundary drops
    q = boundary_point(64, 0, runs([4.9, 2.5, 2.0, 3.6, 3.0]))
    assert (q.eta_s, q.eta_u) == (1e-2, 1e-1)
    # a larger tau keeps it stable, and then nothing above is unstable: undefined
    r = boundary_point(64, 0, runs([4.9, 2.5, 2.0, 3.6, 3.0]), tau=0.6)
    assert r.eta_max is None and "do not reach" in (r.reason or "")
    # an instability constraint violated at 1e-1 makes it unstable though its loss is fine
    rs = runs([4.9, 2.5, 2.0, 2.1, 2.2])
    rs[3] = Run(1e-1, 2.1, False, True, 5.0)
    v = boundary_point(64, 0, rs)
    assert (v.eta_s, v.eta_u) == (1e-2, 1e-1) and v.unstable == [1e-4, 1e-1]


def test_eta_opt_is_the_vertex_of_the_parabola_through_three_points() -> None:
    losses = [4.0, 2.6, 2.0, 2.3, None]
    p = boundary_point(64, 0, runs(losses))
    x = np.log([1e-3, 1e-2, 1e-1])
    c2, c1, _ = np.polyfit(x, [2.6, 2.0, 2.3], 2)  # numpy's parabola, independently
    assert p.eta_opt == pytest.approx(math.exp(-c1 / (2 * c2)), rel=1e-9)
    assert 1e-3 < p.eta_opt < 1e-1  # type: ignore[operator]
    # at the edge of the tried range: eta* itself
    edge = boundary_point(64, 0, runs([2.0, 2.5, 3.0, None, None]))
    assert edge.eta_opt == 1e-4 and edge.eta_star == 1e-4


def test_bisection_steps_and_final_ratio() -> None:
    grid_runs = runs([4.0, 2.6, 2.0, None, None])
    # the ladder tried sqrt-spaced rates between 1e-2 (stable) and 1e-1 (unstable)
    mids = [1e-2 * 10**0.5, 1e-2 * 10**0.25, 1e-2 * 10**0.375]
    extra = [Run(mids[0], None, True, False, 5.0), Run(mids[1], 2.2, False, False, 5.0),
             Run(mids[2], 2.4, False, False, 5.0)]  # fmt: skip
    p = boundary_point(64, 0, grid_runs + extra, grid=GRID)
    assert p.bisection_steps == 3
    assert (p.eta_s, p.eta_u) == pytest.approx((mids[2], mids[0]))
    assert p.ratio == pytest.approx(10**0.125)
    assert p.eta_max == pytest.approx(math.sqrt(mids[2] * mids[0]))
    assert boundary_point(64, 0, grid_runs, grid=GRID).bisection_steps == 0


def test_undefined_cases_are_reported_never_filled_in() -> None:
    all_unstable = boundary_point(64, 0, runs([None] * 5))
    assert all_unstable.eta_max is None and all_unstable.eta_opt is None
    assert "below l_0" in (all_unstable.reason or "")
    all_stable = boundary_point(64, 0, runs([3.0, 2.5, 2.0, 2.1, 2.2]))
    assert all_stable.eta_max is None and all_stable.eta_opt is not None
    assert "do not reach" in (all_stable.reason or "")
    no_init = boundary_point(64, 0, [Run(e, 2.0, False, False, None) for e in GRID])
    assert no_init.eta_max is None and "step-0" in (no_init.reason or "")
    assert boundary_point(64, 0, []).reason == "no finished trial"


# --- across widths: made-up trials with a known power-law boundary -------------------------------

WIDTHS = [32.0, 64.0, 128.0, 256.0]
SEEDS = [0, 1, 2]
FINE = [10 ** (k / 4) for k in range(-16, 3)]  # 1e-4 .. 10^0.5, four per decade


def true_boundary(w: float, seed: int) -> float:
    """The learning rate above which training diverges: ~ w^-0.8, a seed-dependent wobble."""
    return 0.9 * (w / 32) ** -0.8 * (1.0 + 0.07 * ((seed * 7 + int(w)) % 5 - 2))


def true_opt(w: float) -> float:
    return 0.05 * (w / 32) ** -0.6


def made_up(w: float, seed: int) -> list[Run]:
    l0 = 6.0 + 0.01 * seed
    out = []
    for e in FINE:
        if e > true_boundary(w, seed):
            out.append(Run(e, None, True, False, l0))
        else:  # a shallow bowl in log eta: everything below the boundary stays within tau
            out.append(Run(e, 3.0 + 0.02 * (math.log(e / true_opt(w))) ** 2, False, False, l0))
    return out


def expected_bracket(w: float, seed: int) -> tuple[float, float]:
    bnd = true_boundary(w, seed)
    return max(e for e in FINE if e <= bnd), min(e for e in FINE if e > bnd)


def t_mean(values: list[float]) -> tuple[float, float, float]:
    a = np.asarray(values)
    half = stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half)


def test_the_fit_and_the_held_out_check_against_numpy() -> None:
    data = {(w, s): made_up(w, s) for w in WIDTHS for s in SEEDS}
    g = group_boundary({"arm": "none"}, data, target_width=1024.0, grid=FINE)
    assert g.widths == WIDTHS and len(g.points) == 12
    bs, preds = [], []
    for s in SEEDS:
        emax = []
        for w in WIDTHS:
            lo, hi = expected_bracket(w, s)
            (p,) = [p for p in g.points if (p.width, p.seed) == (w, s)]
            assert (p.eta_s, p.eta_u) == pytest.approx((lo, hi))
            emax.append(math.sqrt(lo * hi))
        b, a = np.polyfit(np.log(WIDTHS), np.log(emax), 1)
        bs.append(b)
        preds.append(a + b * math.log(1024.0))
        (sf,) = [f for f in g.eta_max_fit.seeds if f.seed == s]
        assert (sf.a, sf.b) == pytest.approx((a, b), rel=1e-9)
    mean, lo, hi = t_mean(bs)
    fit = g.eta_max_fit
    assert fit.n_seeds == 3 and fit.target_width == 1024.0
    assert (fit.b, fit.b_low, fit.b_high) == pytest.approx((mean, lo, hi), rel=1e-9)
    assert fit.b == pytest.approx(-0.8, abs=0.15)  # it finds the generating exponent
    pm, plo, phi = t_mean(preds)
    assert (fit.prediction, fit.prediction_low, fit.prediction_high) == pytest.approx(
        (math.exp(pm), math.exp(plo), math.exp(phi)), rel=1e-9
    )
    # the band ends at the target width with the prediction and its interval, and at each
    # width is the t interval over seeds of a + b log w
    end = fit.band[-1]
    assert (end.width, end.eta, end.low, end.high) == pytest.approx(
        (1024.0, fit.prediction, fit.prediction_low, fit.prediction_high), rel=1e-9
    )
    assert fit.band[0].width == pytest.approx(32.0)
    lines = [np.polyfit(np.log(WIDTHS), np.log([math.sqrt(math.prod(expected_bracket(w, s)))
                                                for w in WIDTHS]), 1) for s in SEEDS]  # fmt: skip
    for bp in fit.band:
        m, lo_, hi_ = t_mean([float(b * math.log(bp.width) + a) for b, a in lines])
        assert (bp.eta, bp.low, bp.high) == pytest.approx(
            (math.exp(m), math.exp(lo_), math.exp(hi_)), rel=1e-9
        )
    # eta_opt: the vertex recovers the bowl's centre, so its exponent is -0.6
    assert g.eta_opt_fit.b == pytest.approx(-0.6, abs=0.02)
    # held out: refit on 32..128 per seed, predict 256, ratio to the measured eta_max
    ratios = []
    for s in SEEDS:
        small = WIDTHS[:-1]
        e = [math.sqrt(math.prod(expected_bracket(w, s))) for w in small]
        b, a = np.polyfit(np.log(small), np.log(e), 1)
        measured = math.sqrt(math.prod(expected_bracket(256.0, s)))
        ratios.append(math.exp(a + b * math.log(256.0)) / measured)
    h = g.holdout
    assert h is not None and h.width == 256.0 and h.n_seeds == 3
    assert [x.ratio for x in h.seeds] == pytest.approx(ratios, rel=1e-9)
    rm, rlo, rhi = t_mean([math.log(r) for r in ratios])
    assert (h.ratio, h.ratio_low, h.ratio_high) == pytest.approx(
        (math.exp(rm), math.exp(rlo), math.exp(rhi)), rel=1e-9
    )


def test_fits_leave_out_what_they_cannot_fit() -> None:
    # one width: no fit, and no held-out check below three widths
    one = fit_power_law({0: {64.0: 0.1}, 1: {64.0: 0.12}}, 256.0)
    assert one.b is None and one.n_seeds == 0 and "two widths" in (one.reason or "")
    assert [o["seed"] for o in one.left_out] == [0, 1]
    assert holdout_check({0: {32.0: 0.2, 64.0: 0.1}}) is None
    # a seed undefined at the largest width is left out of the check, not filled in
    h = holdout_check({0: {32.0: 0.4, 64.0: 0.2, 128.0: 0.1}, 1: {32.0: 0.4, 64.0: 0.2,
                                                                 128.0: None}})  # fmt: skip
    assert h is not None and [x.seed for x in h.seeds] == [0]
    assert h.left_out[0]["seed"] == 1 and "128" in h.left_out[0]["reason"]
    assert h.ratio == pytest.approx(1.0) and h.ratio_low is None  # one seed: no interval
    # a seed with one defined width is left out of the fit, the others fit
    f = fit_power_law({0: {32.0: 0.4, 64.0: 0.2}, 1: {32.0: None, 64.0: 0.2}}, 128.0)
    assert f.n_seeds == 1 and f.b == pytest.approx(-1.0) and f.prediction == pytest.approx(0.1)
    assert f.b_low is None


# --- end to end: rows written by the real store, read through the API ----------------------------


@pytest.fixture(scope="module")
def seeded(client: TestClient, engine: Engine) -> int:
    return seed_boundary_study(engine)


def get(client: TestClient, sid: int, **params: Any) -> Any:
    return client.get(f"/v1/studies/{sid}/stability-boundary", params=params)


def test_api_answers_the_independent_computation(client: TestClient, seeded: int) -> None:
    r = get(client, seeded, target_width=1024)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["width"] == "model.d_model" and body["group_by"] == ["model.qk_norm"]
    assert body["tau"] == 0.5 and body["target_width"] == 1024.0
    groups = {g["params"]["model.qk_norm"]: g for g in body["groups"]}
    none = groups["none"]
    assert none["widths"] == [32.0, 64.0, 128.0]
    emax: dict[int, list[float]] = {s: [] for s in B_SEEDS}
    for w in B_WIDTHS:
        for s in B_SEEDS:
            (p,) = [p for p in none["points"] if (p["width"], p["seed"]) == (w, s)]
            lrs = B_GRID + ([bisect_lr()] if (w, s, "none") == BISECT else [])
            lo, hi = bracket("none", w, s, lrs)
            assert (p["eta_s"], p["eta_u"]) == pytest.approx((lo, hi))
            assert p["eta_max"] == pytest.approx(math.sqrt(lo * hi))
            assert p["l0"] == pytest.approx(l0_of("none", s))
            assert p["bisection_steps"] == (1 if (w, s, "none") == BISECT else 0)
            emax[s].append(math.sqrt(lo * hi))
    bs = [float(np.polyfit(np.log(B_WIDTHS), np.log(emax[s]), 1)[0]) for s in B_SEEDS]
    mean, lo, hi = t_mean(bs)
    fit = none["eta_max_fit"]
    assert (fit["b"], fit["b_low"], fit["b_high"]) == pytest.approx((mean, lo, hi), rel=1e-9)
    ratios = []
    for s in B_SEEDS:
        b, a = np.polyfit(np.log(B_WIDTHS[:2]), np.log(emax[s][:2]), 1)
        ratios.append(math.exp(a + b * math.log(128)) / emax[s][2])
    assert [x["ratio"] for x in none["holdout"]["seeds"]] == pytest.approx(ratios, rel=1e-9)
    # qk-layernorm: the grid does not reach its boundary at width 32 -> undefined, said so
    ln = groups["layernorm"]
    at32 = [p for p in ln["points"] if p["width"] == 32.0]
    assert all(p["eta_max"] is None and "do not reach" in p["reason"] for p in at32)
    assert ln["eta_max_fit"]["n_seeds"] == 2
    assert all(f["widths"] == [64.0, 128.0] for f in ln["eta_max_fit"]["seeds"])
    assert ln["holdout"]["n_seeds"] == 0 and len(ln["holdout"]["left_out"]) == 2
    (running,) = [p for p in ln["points"] if (p["width"], p["seed"]) == (128.0, 1)]
    assert running["unfinished"] == 1
    # qk-layernorm moves eta_max up at every width where both are defined
    for p in ln["points"]:
        if p["eta_max"] is not None:
            (q,) = [q for q in none["points"] if (q["width"], q["seed"]) == (p["width"], p["seed"])]
            assert p["eta_max"] > q["eta_max"]


def test_default_target_is_the_largest_width_and_tau_changes_the_rule(
    client: TestClient, seeded: int
) -> None:
    body = get(client, seeded).json()
    assert body["target_width"] == 128.0
    # tau: a tighter rule can only lower eta_max or keep it
    tight = get(client, seeded, tau=0.05).json()
    for g, t in zip(body["groups"], tight["groups"], strict=True):
        for p, q in zip(g["points"], t["points"], strict=True):
            if p["eta_max"] is not None and q["eta_max"] is not None:
                assert q["eta_max"] <= p["eta_max"]


def test_bad_requests_name_the_field(client: TestClient, seeded: int) -> None:
    def err(r: Any, field: str, *words: str) -> None:
        assert r.status_code == 422, r.text
        body = r.json()
        assert [e["field"] for e in body["errors"]] == [field]
        for w in words:
            assert w in body["message"]

    err(get(client, seeded, group_by="model.nope"), "group_by", "model.nope")
    err(get(client, seeded, group_by="model.d_model"), "group_by", "model.d_model")
    err(get(client, seeded, width="model.n_layers"), "width", "model.n_layers")
    err(get(client, seeded, tau=0), "tau")
    err(get(client, seeded, tau=2), "tau")
    err(get(client, seeded, target_width=-1), "target_width")
    one = boundary_spec("one-width")
    one["search_space"]["model.d_model"] = {"type": "categorical", "choices": [32]}
    err(get(client, create_via_api(client, one)), "width", "one width")
    no_lr = boundary_spec("no-lr")
    del no_lr["search_space"]["optim.lr"]
    err(get(client, create_via_api(client, no_lr)), "optim.lr", "optim.lr")
    no_init = boundary_spec("no-init")
    no_init["base"] = {**no_init["base"], "eval_at_init": False}
    err(get(client, create_via_api(client, no_init)), "base.eval_at_init", "step-0")
    assert get(client, 999_999).status_code == 404


def test_an_instability_constraint_makes_a_trial_unstable(
    client: TestClient, engine: Engine
) -> None:
    """A study's instability constraint (stability.instability_constraints): a trial whose
    summary violates it is unstable though its loss is fine, a PRUNED one (stopped by it)
    included; a trial that FAILED is a missing point, not an unfinished one."""
    from service.spec import parse_spec
    from service.store import Store
    from service.store.session import make_sessionmaker
    from tests.service.boundary_seed import write_trial

    body = boundary_spec(
        "constrained",
        stability={"instability_constraints": ["max_attn_logit_ever"], "bisect_factor": None},
        constraints=[{"metric": "max_attn_logit_ever", "op": "<=", "value": 1e4}],
    )
    store = Store(make_sessionmaker(engine))
    study, _ = store.studies.create(parse_spec(json.dumps(body).encode(), "json"))
    sid = int(study.id)
    n = 0
    for w in (32, 64):
        for eta in B_GRID:
            # logits blow past the bound from lr 0.03 at width 32, 0.1 at 64 (losses fine)
            logit = 1e5 if eta >= (0.03 if w == 32 else 0.1) else 10.0
            state = "PRUNED" if (w, eta) == (64, 0.1) else "COMPLETE"
            write_trial(store, sid, n, "none", w, 0, eta, state,
                        extra={"max_attn_logit_ever": logit})  # fmt: skip
            n += 1
    write_trial(store, sid, n, "none", 64, 0, 0.05, "FAILED")
    r = get(client, sid, group_by="model.qk_norm")
    assert r.status_code == 200, r.text
    body_out = r.json()
    assert body_out["instability_constraints"] == ["max_attn_logit_ever"]
    (g,) = body_out["groups"]
    p32, p64 = sorted(g["points"], key=lambda p: p["width"])
    assert (p32["eta_s"], p32["eta_u"]) == pytest.approx((0.01, 0.03))
    assert (p64["eta_s"], p64["eta_u"]) == pytest.approx((0.03, 0.1))
    assert 0.1 in p64["unstable"] and p64["unfinished"] == 0  # PRUNED counted; FAILED missing
    assert get(client, sid, width="optim.lr").status_code == 422


def test_the_read_is_bounded_however_long_the_trials(client: TestClient, engine: Engine) -> None:
    """60 trials of 10,000 evaluations each (their summaries' per-evaluation lists about
    250 KiB of JSON apiece): the route's Python memory stays far below what loading them
    would take, and the answer is the same as for short trials."""
    import tracemalloc

    from service.spec import parse_spec
    from service.store import Store
    from service.store.session import make_sessionmaker
    from tests.service.boundary_seed import write_trial

    evals = 10_000
    long_lists = {"eval_steps": list(range(evals)), "val_losses": [2.5] * evals}
    body = boundary_spec("long")
    body["search_space"]["seed"]["grid"] = list(range(10))
    body["search_space"]["model.d_model"]["grid"] = [32, 64]
    body["search_space"]["optim.lr"]["grid"] = [0.01, 0.1, 1.0]
    store = Store(make_sessionmaker(engine))
    study, _ = store.studies.create(parse_spec(json.dumps(body).encode(), "json"))
    sid, n = int(study.id), 0
    for w in (32, 64):
        for s in range(10):
            for eta in (0.01, 0.1, 1.0):
                write_trial(store, sid, n, "none", w, s, eta, "COMPLETE", extra=long_lists)
                n += 1
    get(client, sid)  # warm: imports, the app's first request
    tracemalloc.start()
    try:
        r = get(client, sid)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 200, r.text
    assert peak < 24 * 2**20, f"{peak / 2**20:.1f} MiB"  # the 60 rows whole: about 45 MiB
    (g,) = r.json()["groups"]
    for p in g["points"]:
        lo, hi = bracket("none", int(p["width"]), p["seed"], [0.01, 0.1, 1.0])
        assert (p["eta_s"], p["eta_u"]) == pytest.approx((lo, hi))
