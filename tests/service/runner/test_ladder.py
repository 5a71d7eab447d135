"""The width ladder's bisection decisions (service/runner/ladder.py) without a cluster: which
trial each cell gets next, that bisection stops at the factor in the number of steps the
halving predicts with the true boundary inside the final bracket, and the study-definition
checks at POST. The boundary here is an oracle (a known function of width and seed)."""

from __future__ import annotations

import json
import math
from typing import Any

import optuna
import pytest
from fastapi.testclient import TestClient

from service.read.stability_boundary import (
    Run,
    StabilityBoundary,
    group_boundary,
)
from service.runner.ladder import Ladder, grid_size, proposals
from service.runner.search import make_sampler
from service.spec import StudySpec, parse_spec
from tests.service.boundary_seed import GRID, WIDTHS, boundary_spec

SEEDS = [0, 1]


def ladder_spec(**stability: Any) -> StudySpec:
    body = boundary_spec("ladder", stability={"bisect_factor": math.sqrt(2), **stability})
    return parse_spec(json.dumps(body).encode(), "json")


def oracle(norm: str, width: float, seed: int) -> float:
    """The learning rate above which a trial diverges (between grid points 0.1 and 1)."""
    return (0.15 if norm == "none" else 0.45) * (32 / width) ** 0.5 * (1 + 0.05 * seed)


def run_at(norm: str, width: float, seed: int, eta: float) -> Run:
    if eta > oracle(norm, width, seed):
        return Run(eta, None, True, False, 6.0)
    return Run(eta, 3.0 + 0.02 * math.log(eta / 0.01) ** 2, False, False, 6.0)


def answer(
    spec: StudySpec, cells: dict[tuple[str, float, int], list[Run]], unfinished: Any = None
) -> StabilityBoundary:
    groups = []
    for norm in ("layernorm", "none"):
        runs = {(w, s): r for (n, w, s), r in cells.items() if n == norm}
        un = {(w, s): k for (n, w, s), k in (unfinished or {}).items() if n == norm}
        groups.append(
            group_boundary({"model.qk_norm": norm}, runs, 128.0, 0.5, GRID, unfinished=un)
        )
    return StabilityBoundary(1, "model.d_model", ["model.qk_norm"], 128.0, 0.5, [], 0.95, groups)


def grid_cells() -> dict[tuple[str, float, int], list[Run]]:
    return {
        (n, float(w), s): [run_at(n, w, s, e) for e in GRID]
        for n in ("none", "layernorm")
        for w in WIDTHS
        for s in SEEDS
    }


def test_grid_size_is_the_grid_samplers() -> None:
    spec = ladder_spec()
    assert grid_size(spec) == len(GRID) * len(WIDTHS) * 2 * 2  # lr x width x norm x seed
    # the same count Optuna's grid sampler enumerates
    assert len(make_sampler(spec)._all_grids) == grid_size(spec)  # type: ignore[attr-defined]


def test_each_cell_gets_its_midpoint_unless_finished_or_narrow_or_undefined() -> None:
    spec = ladder_spec()
    cells = grid_cells()
    # one cell still has a trial running: it waits
    props = proposals(spec, answer(spec, cells, unfinished={("none", 64.0, 1): 1}))
    keys = {(p["model.qk_norm"], p["model.d_model"], p["seed"]) for p in props}
    assert len(props) == 2 * len(WIDTHS) * len(SEEDS) - 1 and ("none", 64, 1) not in keys
    for p in props:
        assert set(p) == {"optim.lr", "model.d_model", "model.qk_norm", "seed"}
        assert isinstance(p["model.d_model"], int) and isinstance(p["seed"], int)
        b = oracle(p["model.qk_norm"], p["model.d_model"], p["seed"])
        lo = max(e for e in GRID if e <= b)
        hi = min(e for e in GRID if e > b)
        assert p["optim.lr"] == pytest.approx(math.sqrt(lo * hi))
    # a bracket already at the factor gets nothing; nor does an undefined one
    narrow = dict(cells)
    narrow[("none", 32.0, 0)] = [run_at("none", 32, 0, e) for e in (0.01, 0.1, 0.14, 0.19)]
    narrow[("none", 64.0, 0)] = [run_at("none", 64, 0, e) for e in (0.001, 0.01)]  # all stable
    keys = {
        (p["model.qk_norm"], p["model.d_model"], p["seed"])
        for p in proposals(spec, answer(spec, narrow))
    }
    assert ("none", 32, 0) not in keys and ("none", 64, 0) not in keys
    assert ("none", 128, 0) in keys
    # no bisect_factor: no bisection at all
    assert proposals(ladder_spec(bisect_factor=None), answer(spec, cells)) == []


@pytest.mark.parametrize("factor", [math.sqrt(2), 1.1])
def test_bisection_stops_at_the_factor_with_the_boundary_inside(factor: float) -> None:
    spec = ladder_spec(bisect_factor=factor)
    cells = grid_cells()
    added = {k: 0 for k in cells}
    for _ in range(50):
        props = proposals(spec, answer(spec, cells))
        if not props:
            break
        for p in props:
            k = (p["model.qk_norm"], float(p["model.d_model"]), p["seed"])
            cells[k].append(run_at(k[0], k[1], k[2], p["optim.lr"]))
            added[k] += 1
    else:
        pytest.fail("bisection did not stop")
    final = answer(spec, cells)
    for g in final.groups:
        for pt in g.points:
            norm = g.params["model.qk_norm"]
            assert pt.ratio is not None and pt.ratio <= factor * (1 + 1e-9)
            assert pt.eta_s <= oracle(norm, pt.width, pt.seed) < pt.eta_u  # type: ignore[operator]
            # halving log(eta_u / eta_s) from the grid's bracket of 10x (0.1 .. 1 or 0.3 ..
            # 1: 3.33x) down to the factor
            b = oracle(norm, pt.width, pt.seed)
            r0 = min(e for e in GRID if e > b) / max(e for e in GRID if e <= b)
            steps = math.ceil(math.log2(math.log(r0) / math.log(factor)))
            assert pt.bisection_steps == added[(norm, pt.width, pt.seed)] == steps


def test_the_ladder_reads_again_only_after_a_result() -> None:
    spec = ladder_spec()
    reads = []

    def read() -> StabilityBoundary:
        reads.append(1)
        return answer(spec, grid_cells())

    ladder = Ladder(spec, 1, None, read=read)  # type: ignore[arg-type]
    first = [ladder.next() for _ in range(2 * len(WIDTHS) * len(SEEDS))]
    assert all(p is not None for p in first) and len(reads) == 1
    assert ladder.next() is None and len(reads) == 1  # nothing new until a trial finishes
    ladder.changed()
    assert ladder.next() is not None and len(reads) == 2
    assert Ladder.wanted(spec) and not Ladder.wanted(ladder_spec(bisect_factor=None))


def test_enqueued_parameters_reach_the_trial_under_the_grid_sampler() -> None:
    """What the runner does with a proposal: Optuna's next ask gets exactly it, off the grid."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = ladder_spec()
    study = optuna.create_study(sampler=make_sampler(spec))
    (p, *_) = proposals(spec, answer(spec, grid_cells()))
    study.enqueue_trial(p)
    from service.runner.configs import suggest

    assert suggest(spec, study.ask()) == p


# --- the study definition, checked at POST -------------------------------------------------------


def test_a_bad_ladder_is_refused_at_post_naming_the_field(client: TestClient) -> None:
    def err(body: dict[str, Any], field: str) -> None:
        r = client.post("/v1/studies", json=body)
        assert r.status_code == 422, r.text
        assert [e["field"] for e in r.json()["errors"]] == [field], r.text

    def spec(**over: Any) -> dict[str, Any]:
        return boundary_spec("bad-ladder", **over)

    err(spec(stability={"bisect_factor": 1.0}), "stability.bisect_factor")
    err(spec(stability={"tau": 0}), "stability.tau")
    err(spec(stability={"width": "model.n_layers"}), "stability.width")
    err(spec(stability={}, sampler={"kind": "random", "seed": 0}), "stability.bisect_factor")
    err(spec(stability={"instability_constraints": ["max_attn_logit_ever"]}),
        "stability.instability_constraints.0")  # fmt: skip
    no_init = spec(stability={})
    no_init["base"] = {**no_init["base"], "eval_at_init": False}
    err(no_init, "base.eval_at_init")
    ok = spec(
        stability={"instability_constraints": ["max_attn_logit_ever"]},
        constraints=[{"metric": "max_attn_logit_ever", "op": "<=", "value": 1e4}],
    )
    r = client.post("/v1/studies", json=ok)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["stability"]["bisect_factor"] == pytest.approx(math.sqrt(2))


def test_a_categorical_width_is_proposed_as_its_choice() -> None:
    body = boundary_spec("ladder-cat", stability={})
    body["search_space"]["model.d_model"] = {"type": "categorical", "choices": WIDTHS}
    spec = parse_spec(json.dumps(body).encode(), "json")
    props = proposals(spec, answer(spec, grid_cells()))
    assert props and all(type(p["model.d_model"]) is int for p in props)
    assert {p["model.d_model"] for p in props} == set(WIDTHS)
