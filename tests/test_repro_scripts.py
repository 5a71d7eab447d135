"""The statistics the reproduction tables rest on (scripts/intervals.py) and Dong's rate per
trial (scripts/dong_rate.py), checked against published quantiles, hand-worked cases and
synthetic decays with a known rate."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from dong_rate import LOG3, rate  # noqa: E402
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


def test_doubly_exponential_decay_has_slope_log3_and_no_bend() -> None:
    ratios = [math.exp(-0.1 * 3.0**layer) for layer in range(25)]
    r = rate(ratios, floor=1e-13)
    assert r.slope == pytest.approx(LOG3, rel=1e-9)
    assert r.bend == pytest.approx(0.0, abs=1e-9)
    assert r.reach == 5  # exp(-24.3) = 3e-11 is usable, exp(-72.9) is below the floor


def test_exponential_decay_has_a_falling_slope() -> None:
    ratios = [0.9 * math.exp(-0.5 * layer) for layer in range(25)]
    r = rate(ratios, floor=1e-13)
    assert r.reach == 24
    assert r.slope is not None and 0.0 < r.slope < 0.5
    assert r.bend is not None and r.bend < -0.1  # the slope goes to 0 with depth


def test_layers_at_one_or_more_are_skipped_and_two_points_give_no_slope() -> None:
    r = rate([1.005, 0.5, 1e-14, 1e-15], floor=1e-13)
    assert r.slope is None and r.bend is None and r.reach == 1
    r = rate([1.005, 0.5, 0.1, 1e-3, 1e-14], floor=1e-13)
    assert r.slope is not None and r.reach == 3
