"""The interval and test code every reproduction table uses (docs/reproductions.md, "How to
read the numbers"). One place, so that every table follows the same rules:

- Student-t quantiles for every sample size (scipy's, not 1.96 past some df);
- each quantity has ONE scale, fixed by what it is, never chosen from the data: values in
  [0, 1] by definition (normalised entropy, top-1 mass, target mass) on the logit scale,
  clipped to [CLIP, 1 - CLIP] first so that a value of exactly 0 or 1 still has a logit and
  no interval can leave [0, 1]; positive quantities spanning decades (rank ratio, which is not
  bounded by 1, and eigen-variance) on the log scale; losses, means and differences raw;
- comparisons are paired by seed (a dict seed -> value on each side, matched by key, never
  by list position), and refuse to run when the two sides do not hold the same seeds;
- Fisher's exact test for counts, and TOST for equivalence within a stated margin.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from scipy import stats

# Interval, t_quantile and t_interval live in the service (the LR-sensitivity route needs them
# too): one implementation, imported from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from service.read.intervals import Interval, t_interval, t_quantile  # noqa: E402

__all__ = [
    "CLIP",
    "SCALE_OF",
    "Interval",
    "Scale",
    "fisher_two_sided",
    "paired_diffs",
    "scaled_interval",
    "t_interval",
    "t_quantile",
    "tost",
]

Scale = Literal["raw", "logit", "log"]
CLIP = 1e-6

# The scale of each quantity the tables report, fixed by its definition.
SCALE_OF: dict[str, Scale] = {
    "min_norm_entropy": "logit",
    "min_norm_entropy_ever": "logit",
    "init_min_norm_entropy": "logit",
    "attn_entropy_norm": "logit",
    "top1_mass": "logit",
    "attn_top1_mass": "logit",
    "target_mass": "logit",
    "attn_target_mass": "logit",
    "final_rank_ratio": "log",
    "init_rank_ratio": "log",
    "rank_ratio": "log",
    "qk_eig_var": "log",
    "init_qk_eig_var": "log",
    "final_val_loss": "raw",
    "best_val_loss": "raw",
    "qk_eig_mean": "raw",
    "qk_eig_mean_rank": "raw",
    "longest_plateau": "raw",
}


def _forward(scale: Scale) -> Callable[[float], float]:
    if scale == "logit":

        def logit(v: float) -> float:
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{v} is outside [0, 1]: not a logit-scale quantity")
            c = min(max(v, CLIP), 1.0 - CLIP)
            return math.log(c / (1.0 - c))

        return logit
    if scale == "log":

        def log(v: float) -> float:
            if v <= 0.0:
                raise ValueError(f"{v} is not positive: not a log-scale quantity")
            return math.log(v)

        return log
    return float


def _back(scale: Scale) -> Callable[[float], float]:
    if scale == "logit":
        return lambda x: 1.0 / (1.0 + math.exp(-x))
    if scale == "log":
        return math.exp
    return float


def scaled_interval(values: Sequence[float], scale: Scale, conf: float = 0.95) -> Interval:
    """A t interval on the given scale, mapped back (centre: the back-transformed mean:
    the geometric mean on the log scale)."""
    fwd, back = _forward(scale), _back(scale)
    iv = t_interval([fwd(v) for v in values], conf)
    return Interval(back(iv.centre), back(iv.lo), back(iv.hi), iv.n)


def paired_diffs(
    a: Mapping[int, float], b: Mapping[int, float], scale: Scale = "raw"
) -> list[float]:
    """a - b per seed, on `scale` (logit / log differences are log odds / log ratios),
    matched by seed; refuses unless both sides hold exactly the same seeds."""
    if set(a) != set(b):
        raise ValueError(f"unpaired seeds: {sorted(set(a) ^ set(b))}")
    fwd = _forward(scale)
    return [fwd(a[s]) - fwd(b[s]) for s in sorted(a)]


def fisher_two_sided(k1: int, n1: int, k2: int, n2: int) -> float:
    """Fisher's exact test of k1 of n1 against k2 of n2 (two-sided p)."""
    _, p = stats.fisher_exact([[k1, n1 - k1], [k2, n2 - k2]], alternative="two-sided")
    return float(p)


def tost(diffs: Sequence[float], margin: float, alpha: float = 0.05) -> tuple[Interval, bool]:
    """Two one-sided tests: equivalent within +-margin at level alpha iff the (1 - 2 alpha)
    t interval of the differences lies inside (-margin, margin)."""
    iv = t_interval(diffs, conf=1.0 - 2.0 * alpha)
    return iv, -margin < iv.lo and iv.hi < margin
