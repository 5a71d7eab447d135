"""Student-t intervals of a mean: the one implementation the service and the reproduction
scripts share (scripts/intervals.py re-exports these, docs/reproductions.md "How to read the
numbers": Student-t quantiles for every sample size, never 1.96 past some df).

scipy is imported on first use, not at import, so the API process pays for it only when a
route needs an interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "t_interval", "t_quantile"]


@dataclass(frozen=True)
class Interval:
    """A centre and a two-sided interval on the quantity's own scale (mapped back)."""

    centre: float
    lo: float
    hi: float
    n: int

    def fmt(self, f: Callable[[float], str] = lambda v: f"{v:.3g}") -> str:
        return f"{f(self.centre)} [{f(self.lo)}, {f(self.hi)}]"

    def excludes(self, value: float) -> bool:
        return not self.lo <= value <= self.hi


def t_quantile(df: int, conf: float = 0.95) -> float:
    """The two-sided Student-t quantile for `df` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df >= 1), got df = {df}")
    from scipy import stats

    return float(stats.t.ppf(0.5 + conf / 2, df))


def t_interval(values: Sequence[float], conf: float = 0.95) -> Interval:
    """Mean and Student-t interval of raw values (at least 2)."""
    n = len(values)
    m = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1, conf) * sd / math.sqrt(n)
    return Interval(m, m - half, m + half, n)
