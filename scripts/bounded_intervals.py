"""95 % intervals for bounded per-trial quantities in docs/results/archive/*.jsonl (second round).

docs/reproductions.md section 4 first gave Student-t intervals on the raw values, which for a
quantity in [0, 1] (normalised entropy) can run below 0 or above 1. Here the t interval
(three seeds: t = 4.30) is taken on the quantity's own fixed scale (scripts/intervals.py:
logit for normalised entropy, clipped to [1e-6, 1 - 1e-6]; log for the rank ratio, which is
positive but not bounded by 1) and mapped back; the centre is the mapped-back mean of the
transformed values. (Until round 3 the scale was chosen from the data: logit when every value
lay in (0, 1), else log, so an entropy of exactly 1.0 got a log-scale interval above 1.)
Also prints Fisher's exact test for the collapse counts quoted there.
Run: python scripts/bounded_intervals.py
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import SCALE_OF, Scale, fisher_two_sided, scaled_interval  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "archive"  # round 2


def _load(name: str) -> list[dict[str, Any]]:
    """The records in seed order (the service's are in trial-number order)."""
    lines = (RESULTS / name).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return sorted(records, key=lambda r: r["params"].get("seed", 0))


def bounded_interval(values: list[float], scale: Scale) -> tuple[str, float, float, float]:
    """(scale, centre, lo, hi): a t interval on the quantity's own fixed scale, mapped back
    (scripts/intervals.py: logit for quantities in [0, 1], log for positive ones). The scale
    is never chosen from the data."""
    iv = scaled_interval(values, scale)
    return scale, iv.centre, iv.lo, iv.hi


def _show(label: str, values: list[float], quantity: str) -> None:
    scale, c, lo, hi = bounded_interval(values, SCALE_OF[quantity])
    raw = ", ".join(f"{v:.3g}" for v in values)
    print(f"{label:40s} {c:.3g} [{lo:.3g}, {hi:.3g}] ({scale}; seeds: {raw})")


def main() -> None:
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in _load("rank_collapse_variants.jsonl"):
        p = r["params"]
        groups[(p["model.block"], p["model.n_layers"])].append(r["summary"]["init_rank_ratio"])
    print("4.1 init_rank_ratio (last layer, step 0)")
    for (block, depth), vals in sorted(groups.items()):
        _show(f"  {block} L={depth}", vals, "init_rank_ratio")

    ent: dict[tuple[float, str, float], list[float]] = defaultdict(list)
    for r in _load("entropy_collapse.jsonl"):
        p = r["params"]
        key = (p["optim.lr"], p["model.qk_norm"], p["regularizer.lambda"])
        ent[key].append(r["summary"]["min_norm_entropy"])
    print("4.3 min_norm_entropy (final)")
    for key, vals in sorted(ent.items()):
        _show(f"  lr {key[0]} {key[1]} lambda {key[2]}", vals, "min_norm_entropy")

    loc: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for r in _load("localization_v2.jsonl"):
        loc[r["params"]["regularizer.lambda"]].append(r["summary"])
    print("4.2 (final)")
    for lam, summaries in sorted(loc.items()):
        for field in ("min_norm_entropy", "final_rank_ratio"):
            _show(f"  lambda {lam} {field}", [s[field] for s in summaries], field)

    # Collapse counts (summary flag: final entropy below the threshold), each setting at lr
    # 0.03 against lr 0.03 with no remedy, and lr 0.001 with no remedy against it too.
    counts: dict[tuple[float, str, float], list[bool]] = defaultdict(list)
    for r in _load("entropy_collapse.jsonl"):
        p = r["params"]
        key = (p["optim.lr"], p["model.qk_norm"], p["regularizer.lambda"])
        counts[key].append(bool(r["summary"]["entropy_collapse"]))
    ref = counts[(0.03, "none", 0.0)]
    print(f"4.3 Fisher exact vs lr 0.03 / none / lambda 0 ({sum(ref)} of {len(ref)} collapsed)")
    for key, flags in sorted(counts.items()):
        if key == (0.03, "none", 0.0):
            continue
        table = [[sum(ref), len(ref) - sum(ref)], [sum(flags), len(flags) - sum(flags)]]
        p_two = fisher_two_sided(sum(ref), len(ref), sum(flags), len(flags))
        _, p_one = stats.fisher_exact(table, alternative="greater")
        print(
            f"  lr {key[0]} {key[1]} lambda {key[2]}: {sum(flags)} of {len(flags)}, "
            f"two-sided p = {p_two:.3f}, one-sided p = {p_one:.3f}"
        )


if __name__ == "__main__":
    main()
