"""Learning-rate sensitivity (METRICS.md section 9): the computation against hand-computed
numbers, then end to end on trial and metric rows written by the real store (insert_queued,
record_starts, store_reports, record_result) and read through GET
/v1/studies/{id}/lr-sensitivity, on SQLite and PostgreSQL. Expectations are computed
independently here, from the numbers the test wrote."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from service.read.lr_sensitivity import TrialPoint, lr_sensitivity, summarize_group
from service.spec import parse_spec
from tests.service.conftest import create_via_api
from tests.service.lr_seed import (
    E2E_GRID,
    NORMS,
    SEEDS,
    expected_group,
    final_of,
    l0_of,
    lr_spec,
    seed_lr_study,
)

T_2DF = 4.302652729911275  # Student t, 97.5 % quantile, 2 degrees of freedom (tables)


# --- the computation, by hand -------------------------------------------------------------------


def test_definition_edge_cases_of_metrics_md() -> None:
    # "0 when every learning rate reaches the best loss"
    assert lr_sensitivity([2.0, 2.0, 2.0], l0=5.0) == 0.0
    # "l_0 - l* when only one does" (the others diverged: counted as l_0)
    assert lr_sensitivity([5.0, 2.0, 5.0, 5.0], l0=5.0) == pytest.approx(0.75 * (5.0 - 2.0))
    # a finite loss above l_0 is clipped to l_0 by min(l, l_0)
    assert lr_sensitivity([9.0, 2.0], l0=5.0) == pytest.approx((5.0 - 2.0 + 0.0) / 2)


GRID = [1e-3, 1e-2, 1e-1, 1.0]


def pts(seed: int, l0: float, losses: list[float | None], diverged: tuple[int, ...] = ()):
    return [
        TrialPoint(seed, eta, loss, i in diverged, l0)
        for i, (eta, loss) in enumerate(zip(GRID, losses, strict=True))
        if loss is not None or i in diverged
    ]


def test_group_against_a_hand_computation() -> None:
    trials = [
        # seed 0: l0 5.0; the top learning rate DIVERGED -> 5.0; l* 2
        # terms 1, 0, 2, 3 -> 1.5
        *pts(0, 5.0, [3.0, 2.0, 4.0, None], diverged=(3,)),
        # seed 1: l0 5.2; 6.0 is finite but above l0 (clipped); NaN counts as l0; l* 2.5
        # terms 1.0, 0, 2.7, 2.7 -> 1.6
        *pts(1, 5.2, [3.5, 2.5, 6.0, math.nan]),
        # seed 2: l0 5.1, all train; l* 2.2; terms 0.6, 0, 0.2, 0.4 -> 0.3
        *pts(2, 5.1, [2.8, 2.2, 2.4, 2.6]),
        # seed 3: lr 1 not finished -> left out, not biasing
        *pts(3, 5.0, [2.0, 2.0, 2.0, None]),
    ]
    g = summarize_group({"model.qk_norm": "none"}, GRID, trials, {3: {1.0: "RUNNING"}})
    assert [s.seed for s in g.seeds] == [0, 1, 2]
    assert [s.sensitivity for s in g.seeds] == pytest.approx([1.5, 1.6, 0.3])
    assert g.seeds[0].losses == [3.0, 2.0, 4.0, 5.0]
    assert g.seeds[1].losses == pytest.approx([3.5, 2.5, 6.0, 5.2])
    assert g.sensitivity == pytest.approx(3.4 / 3)
    # sd of (1.5, 1.6, 0.3): sqrt(1.04667 / 2) = 0.72342
    half = T_2DF * math.sqrt((0.3667**2 + 0.4667**2 + 0.8333**2) / 2) / math.sqrt(3)
    assert g.ci_low == pytest.approx(3.4 / 3 - half, abs=2e-3)
    assert g.ci_high == pytest.approx(3.4 / 3 + half, abs=2e-3)
    assert g.n_seeds == 3
    assert [(o.seed, o.missing_lrs) for o in g.left_out] == [(3, [1.0])]
    assert "1 RUNNING" in g.left_out[0].reason
    # l0: the mean of the seeds' step-0 losses (seed 3 has one too)
    assert g.l0 == pytest.approx((5.0 + 5.2 + 5.1 + 5.0) / 4)
    # the curve at lr 1: seeds 0, 1 (diverged: their l0) and 2; seed 3 has no point
    top = g.curve[-1]
    assert (top.lr, top.n, top.diverged) == (1.0, 3, 2)
    assert (top.median, top.min, top.max) == pytest.approx((5.0, 2.6, 5.2))
    # at lr 0.1, all four seeds: 4.0, 6.0, 2.4, 2.0 -> median 3.2, quartiles by interpolation
    mid = g.curve[2]
    assert (mid.n, mid.median, mid.min, mid.max) == (4, pytest.approx(3.2), 2.0, 6.0)
    assert (mid.q25, mid.q75) == pytest.approx((2.3, 4.5))
    # min(l, l0) per seed, what the definition uses: seed 1's 6.0 is drawn at its l0 5.2
    assert mid.above_l0 == 1
    assert (mid.clipped_median, mid.clipped_min, mid.clipped_max) == pytest.approx((3.2, 2.0, 5.2))
    # diverged seeds already count as their l0: nothing above it at lr 1
    assert top.above_l0 == 0 and top.clipped_max == pytest.approx(5.2)


def test_a_seed_without_step_0_is_left_out_and_one_seed_has_no_interval() -> None:
    trials = [*pts(0, 5.0, [3.0, 2.0, 4.0, 4.5])]
    trials += [TrialPoint(1, eta, 3.0, False, None) for eta in GRID]
    g = summarize_group({}, GRID, trials)
    assert g.n_seeds == 1 and g.sensitivity == pytest.approx((1 + 0 + 2 + 2.5) / 4)
    assert g.ci_low is None and g.ci_high is None
    assert [o.seed for o in g.left_out] == [1] and "step-0" in g.left_out[0].reason


# --- end to end: rows written by the real store, read through the API --------------------------


@pytest.fixture(scope="module")
def seeded(client: TestClient, engine: Engine) -> int:
    return seed_lr_study(engine)


def get(client: TestClient, sid: int, **params: Any) -> Any:
    return client.get(f"/v1/studies/{sid}/lr-sensitivity", params=params)


def test_api_answers_the_independent_computation(client: TestClient, seeded: int) -> None:
    r = get(client, seeded, group_by="model.qk_norm")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["grid"] == E2E_GRID and body["group_by"] == ["model.qk_norm"]
    assert body["log_spaced"] is True and body["confidence"] == 0.95
    groups = {g["params"]["model.qk_norm"]: g for g in body["groups"]}
    assert set(groups) == set(NORMS)
    for norm in NORMS:
        g, want = groups[norm], expected_group(norm)
        assert g["n_seeds"] == 3
        assert [s["seed"] for s in g["seeds"]] == SEEDS
        assert [s["sensitivity"] for s in g["seeds"]] == pytest.approx(want["per_seed"])
        assert g["sensitivity"] == pytest.approx(want["mean"])
        assert (g["ci_low"], g["ci_high"]) == pytest.approx((want["lo"], want["hi"]))
        # l0 from the step-0 val_loss rows (seed 3 of "none" counts: it has a step 0)
        seeds_l0 = [l0_of(norm, s) for s in (SEEDS + [3] if norm == "none" else SEEDS)]
        assert g["l0"] == pytest.approx(sum(seeds_l0) / len(seeds_l0))
        for point, eta in zip(g["curve"], E2E_GRID, strict=True):
            vals = [final_of(norm, s, eta) for s in SEEDS]
            vals = [l0_of(norm, s) if v is None else v for s, v in zip(SEEDS, vals, strict=True)]
            if norm == "none" and eta == 1e-4:
                vals.append(final_of("none", 3, eta))  # seed 3's one finished point
            assert point["lr"] == eta and point["n"] == len(vals)
            assert point["median"] == pytest.approx(statistics.median(vals))
            assert (point["min"], point["max"]) == pytest.approx((min(vals), max(vals)))
            assert point["diverged"] == (3 if norm == "none" and eta == 1.0 else 0)
            seeds = SEEDS + [3] if norm == "none" and eta == 1e-4 else SEEDS
            l0s = [l0_of(norm, s) for s in seeds]
            clipped = [min(v, l0) for v, l0 in zip(vals, l0s, strict=True)]
            assert point["above_l0"] == sum(v > l0 for v, l0 in zip(vals, l0s, strict=True))
            assert point["above_l0"] == (3 if norm == "none" and eta == 0.1 else 0)
            assert point["clipped_median"] == pytest.approx(statistics.median(clipped))
            assert (point["clipped_min"], point["clipped_max"]) == pytest.approx(
                (min(clipped), max(clipped))
            )
    # qk-layernorm: nothing diverges, so it is the less sensitive group
    assert groups["layernorm"]["sensitivity"] < groups["none"]["sensitivity"]
    (out,) = groups["none"]["left_out"]
    assert out["seed"] == 3 and out["missing_lrs"] == E2E_GRID[1:]
    assert "RUNNING" in out["reason"] and "PRUNED" in out["reason"]
    assert "not started" in out["reason"]
    assert groups["layernorm"]["left_out"] == []


def test_default_group_by_is_every_other_searched_parameter(
    client: TestClient, seeded: int
) -> None:
    a, b = get(client, seeded).json(), get(client, seeded, group_by="model.qk_norm").json()
    assert a == b


def test_bad_requests_name_the_field(client: TestClient, seeded: int) -> None:
    def err(r: Any, field: str, *words: str) -> None:
        assert r.status_code == 422, r.text
        body = r.json()
        assert [e["field"] for e in body["errors"]] == [field]
        for w in words:
            assert w in body["message"]

    err(get(client, seeded, group_by="model.nope"), "group_by", "model.nope")
    err(get(client, seeded, group_by="seed"), "group_by", "seed")
    err(get(client, seeded, group_by="optim.lr"), "group_by", "optim.lr")
    no_lr = lr_spec("no-lr")
    del no_lr["search_space"]["optim.lr"]
    sid = create_via_api(client, no_lr)
    err(get(client, sid), "optim.lr", "optim.lr")
    sampled = lr_spec("sampled-lr", sampler={"kind": "random", "seed": 0})
    err(get(client, create_via_api(client, sampled)), "optim.lr", "grid")
    no_init = lr_spec("no-init", base={"steps": 100, "eval_every": 50})
    err(get(client, create_via_api(client, no_init)), "base.eval_at_init", "eval_at_init")
    assert get(client, 999_999).status_code == 404


def test_pooling_a_varying_parameter_is_refused(client: TestClient, engine: Engine) -> None:
    spec = lr_spec("two-factors")
    spec["search_space"]["optim.weight_decay"] = {"type": "categorical", "choices": [0.0, 0.1]}
    sid = create_via_api(client, spec)
    r = get(client, sid, group_by="model.qk_norm")
    assert r.status_code == 422 and "optim.weight_decay" in r.json()["message"]
    r = get(client, sid, group_by=["model.qk_norm", "optim.weight_decay"])
    assert r.status_code == 200 and r.json()["groups"] == []  # no trials yet


def test_needs_the_token(client: TestClient, seeded: int) -> None:
    r = client.get(
        f"/v1/studies/{seeded}/lr-sensitivity", headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401


# --- the shipped definition -----------------------------------------------------------------


def test_the_shipped_definition_is_a_study_the_route_answers() -> None:
    """study_defs/lr_sensitivity.yaml is route-ready: a grid over optim.lr from 1e-4 to 1, at
    least 7 points equally spaced in log lr, grouped by its intervention alone, eval_at_init
    (l_0), nothing pruned, 5 seeds. (tests/test_study_defs.py checks it is a valid study within
    the default limits whose budget is its grid; training is not repeated here, to keep CI
    cheap.)"""
    from service.read.lr_sensitivity import _grid, _group_by, _log_spaced, _measures_init
    from service.store.models import Study
    from tests.conftest import ROOT

    path = ROOT / "study_defs" / "lr_sensitivity.yaml"
    spec = parse_spec(path.read_bytes(), "application/yaml")
    row = Study(id=1, spec=spec.model_dump(mode="json"))
    grid = _grid(row)
    assert len(grid) >= 7 and grid[0] == 1e-4 and grid[-1] == 1.0 and _log_spaced(grid)
    assert _group_by(row, None) == ["model.qk_norm"]
    _measures_init(row)  # no 422
    assert spec.base.eval_at_init and spec.base.task.kind == "lm"
    assert spec.pruner.kind == "none" and spec.constraints == []
    assert len(set(spec.search_space["seed"].grid or [])) >= 5


# --- the unigram floor beside l* (METRICS.md section 9) ------------------------------------------


def _char_corpus(directory: Any, train: str, valid: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.txt").write_text(train)
    (directory / "valid.txt").write_text(valid)
    return str(directory)


def test_unigram_floor_by_hand(tmp_path: Any) -> None:
    """Char-level training text "aaabaaab" (a 6 times, b 2 times; vocabulary <unk>, a, b),
    one evaluation window of "abbab" (context 4): targets b, b, a, b. With add-one smoothing
    p(a) = 7/11, p(b) = 3/11, so the floor is -(3 log 3/11 + log 7/11) / 4."""
    from workers.config import TrialConfig
    from workers.unigram import unigram_floor

    data = _char_corpus(tmp_path / "ab", "aaabaaab", "abbab")
    task = {"kind": "lm", "data_dir": data, "tokenizer": "char", "seq_len": 4}
    config = TrialConfig.model_validate({"task": task, "batch_size": 1, "eval_batches": 1})
    want = -(3 * math.log(3 / 11) + math.log(7 / 11)) / 4
    assert unigram_floor(config) == pytest.approx(want, rel=1e-12)
    synthetic = TrialConfig.model_validate({"task": {"kind": "associative_recall"}})
    assert unigram_floor(synthetic) is None


@pytest.mark.parametrize(("letters", "below"), [(2, False), (40, True)])
def test_route_sets_the_floor_beside_l_star(
    client: TestClient, engine: Engine, tmp_path: Any, letters: int, below: bool
) -> None:
    """The seeded grid's l* is about 3.1 nats. On two letters the floor is about 1 nat, so
    l* is not below it and each group says so; on 40 letters equally often it is log 41 =
    3.71 (add-one: every count n + 1 of 40 n + 41), above l*, and no note is set."""
    from tests.service.lr_seed import seed_char_lm_study

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"[:letters]
    data = _char_corpus(tmp_path / f"c{letters}", alphabet * 5, alphabet * 5)
    sid = seed_char_lm_study(engine, f"floor-{letters}", data)
    # an independent floor: the 8 targets after the first character, each letter 5 times in
    # training (letters == 2: targets b a b a b a b a; counts 5 + 1 of 10 + 3 = 13)
    targets = (alphabet * 5)[1:9]
    counts = {c: 5 for c in alphabet}
    floor = -sum(math.log((counts[c] + 1) / (5 * letters + letters + 1)) for c in targets) / 8
    body = get(client, sid).json()
    for g in body["groups"]:
        assert g["unigram_floor"] is not None, g["note"]
        assert g["unigram_floor"] == pytest.approx(floor, rel=1e-12)
        assert g["l_star"] == pytest.approx(
            sum(min(final_of(g["params"]["model.qk_norm"], s, e) or math.inf for e in E2E_GRID)
                for s in SEEDS) / len(SEEDS)
        )  # fmt: skip
        assert (g["note"] is None) is below
        assert below or "not below the unigram floor" in g["note"]
    assert (g["l_star"] < floor) is below
