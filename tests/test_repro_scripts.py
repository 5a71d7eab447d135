"""The statistics the reproduction tables rest on (scripts/intervals.py) and Dong's rate per
trial (scripts/dong_rate.py), checked against published quantiles, hand-worked cases and
synthetic decays with a known rate."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from dong_rate import (  # noqa: E402
    FIXED_LAYERS,
    LOG3,
    MARGIN,
    MIN_SEEDS,
    cell_test,
    growth,
    holm,
    outcome,
    p_tost,
    p_zero,
    rate,
)
from intervals import (  # noqa: E402
    fisher_two_sided,
    paired_diffs,
    scaled_interval,
    t_interval,
    t_quantile,
    tost,
)


@pytest.mark.parametrize(
    ("df", "q"), [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (12, 2.179), (29, 2.045)]
)
def test_t_quantiles_are_students_for_every_df(df: int, q: float) -> None:
    assert t_quantile(df) == pytest.approx(q, abs=5e-4)
    assert t_quantile(df) > 1.96  # never the normal quantile


def test_t_interval_by_hand() -> None:
    iv = t_interval([1.0, 2.0, 3.0])  # mean 2, sd 1, half-width 4.303 / sqrt(3)
    assert iv.centre == 2.0
    assert iv.hi - 2.0 == pytest.approx(4.3027 / math.sqrt(3), rel=1e-4)


def test_a_bounded_quantity_never_gets_an_interval_outside_0_1() -> None:
    for values in ([1.0, 0.999, 0.95], [0.0, 1e-9, 0.3], [1.0, 1.0, 0.2]):
        iv = scaled_interval(values, "logit")
        assert 0.0 <= iv.lo <= iv.centre <= iv.hi <= 1.0
    with pytest.raises(ValueError, match="outside"):
        scaled_interval([1.01, 0.5], "logit")
    iv = scaled_interval([1.0, 1.01, 0.99], "log")  # the rank ratio may exceed 1
    assert iv.hi > 1.0


def test_pairing_is_by_seed_not_position() -> None:
    a = {0: 1.0, 1: 5.0, 2: 9.0}
    b = {2: 8.0, 0: 0.5, 1: 4.0}  # other insertion order
    assert paired_diffs(a, b) == [0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="unpaired seeds"):
        paired_diffs(a, {0: 1.0, 1: 2.0, 3: 3.0})
    assert paired_diffs({0: math.e}, {0: 1.0}, "log") == [pytest.approx(1.0)]


def test_fisher_and_tost() -> None:
    assert fisher_two_sided(3, 3, 0, 3) == pytest.approx(0.1)
    assert fisher_two_sided(10, 10, 5, 10) == pytest.approx(0.0325, abs=1e-4)
    _, eq = tost([0.001, -0.002, 0.0015, 0.0005], margin=0.02)
    assert eq
    _, eq = tost([0.03, 0.025, 0.035], margin=0.02)
    assert not eq


def _ratios(xs: list[float]) -> list[float]:
    return [math.exp(-x) for x in xs]


def _cubic(c: float, x0: float = 0.05, n: int = 25) -> list[float]:
    """r_l with x_l = -log r_l following the theorem's recursion x_{l+1} = 3 x_l + c."""
    xs = [x0]
    for _ in range(n - 1):
        xs.append(3.0 * xs[-1] + c)
    return _ratios(xs)


@pytest.mark.parametrize("c", [0.0, 0.5, 0.01, 2.0, -0.05])
def test_a_cubic_recursion_gives_log3_at_every_layer_whatever_c(c: float) -> None:
    """c = 0.5 is the case the bend rule read as exponential (slope 1.41, bend -0.63)."""
    g = growth(_cubic(c), floor=1e-13)
    assert len(g) >= 2  # (c = 2 reaches the floor at layer 4)
    for value in g.values():
        assert value == pytest.approx(LOG3, abs=1e-9)


def test_the_slope_depends_on_c_where_the_growth_ratio_does_not() -> None:
    """Why the slope of log x_l is reported and never a verdict: two exactly cubic
    recursions, one rate, two different slopes."""
    slopes = [rate(_cubic(c), floor=1e-13).slope for c in (0.0, 0.5)]
    assert slopes[0] == pytest.approx(LOG3, rel=1e-9)
    assert slopes[1] is not None and abs(slopes[1] - LOG3) > 0.1


@pytest.mark.parametrize(("x0", "step"), [(0.05, 0.7), (-0.02, 0.3), (1.0, 2.5)])
def test_a_linear_x_gives_zero_at_every_layer(x0: float, step: float) -> None:
    xs = [x0 + step * layer for layer in range(25)]
    g = growth(_ratios(xs), floor=1e-13)
    assert set(g) == set(range(1, 24)) - {layer for layer in range(24) if xs[layer + 1] > 29.9}
    for value in g.values():
        assert value == pytest.approx(0.0, abs=1e-9)


def test_only_layers_above_the_floor_and_positive_increments_are_read() -> None:
    # x = 0.1, 0.3, 0.9, 2.7, 8.1, 24.3 (r = 2.8e-11), then 72.9: r = 2e-32 is at the floor
    g = growth(_cubic(0.0, x0=0.1, n=8), floor=1e-13)
    assert sorted(g) == [1, 2, 3, 4]  # log g_4 uses x_3, x_4, x_5; x_6 is at the floor
    # a ratio that rises (x falls) has no growth ratio on either side of the fall
    g = growth(_ratios([0.1, 0.5, 0.4, 1.0, 3.0, 9.0]), floor=1e-13)
    assert sorted(g) == [3, 4]
    assert g[3] == pytest.approx(math.log(2.0 / 0.6))


def _noisy(centre: float, n: int, sd: float = 0.3, seed: int = 0) -> dict[int, dict[int, float]]:
    rng = np.random.default_rng(seed)
    return {s: {layer: centre + sd * rng.standard_normal() for layer in FIXED_LAYERS}
            for s in range(n)}  # fmt: skip


def test_the_pre_registered_outcomes_on_synthetic_cells() -> None:
    doubly = cell_test(_noisy(LOG3, 20))
    assert doubly.testable and doubly.p_doubly < 0.05 and doubly.at_bound_base
    assert outcome(doubly, doubly.p_doubly, doubly.p_exponential).startswith("doubly")
    expo = cell_test(_noisy(0.0, 20, seed=1))
    assert expo.p_doubly == 1.0 or expo.p_doubly > 0.05
    assert expo.p_exponential < 0.05
    assert outcome(expo, expo.p_doubly, expo.p_exponential) == "exponential"
    wide = cell_test(_noisy(0.3, 20, sd=2.0, seed=2))
    assert outcome(wide, wide.p_doubly, wide.p_exponential) == "inconclusive"
    few = cell_test(_noisy(LOG3, MIN_SEEDS - 1))
    assert not few.testable
    assert outcome(few, few.p_doubly, few.p_exponential) == "not testable (< 10 seeds)"
    # one fixed layer at 0 and the cell is not doubly exponential (intersection-union)
    mixed = _noisy(LOG3, 20, seed=3)
    for s, g in mixed.items():
        g[FIXED_LAYERS[-1]] = 0.3 * np.random.default_rng(10 + s).standard_normal()
    cell = cell_test(mixed)
    assert cell.p_doubly > 0.05
    assert outcome(cell, cell.p_doubly, cell.p_exponential) == "inconclusive"


def test_p_values_agree_with_the_intervals() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        n = int(rng.integers(3, 25))
        xs = list(rng.normal(rng.normal(0.0, 0.4), 1.0, size=n))
        assert (p_zero(xs) < 0.05) == t_interval(xs).excludes(0.0)
        assert (p_tost(xs, MARGIN) < 0.05) == tost(xs, MARGIN)[1]


def test_holm_by_hand() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.3, 0.4, 0.9]) == pytest.approx([0.9, 0.9, 0.9])
