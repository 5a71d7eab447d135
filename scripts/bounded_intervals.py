"""95 % intervals for bounded per-trial ratios in docs/results/*.jsonl, on a bounded scale.

docs/reproductions.md section 4 first gave Student-t intervals on the raw values, which for a
ratio in [0, 1] (rank ratio, normalised entropy) can run below 0 or above 1. Here the t
interval (three seeds: t = 4.30) is taken on the logit scale when every value lies in
(0, 1), else on the log scale (positive values), and mapped back; the centre is the mapped
back mean of the transformed values. Also prints Fisher's exact test for the collapse
counts quoted there. Run: python scripts/bounded_intervals.py
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from scipy import stats

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def _load(name: str) -> list[dict[str, Any]]:
    """The records in seed order (the service's are in trial-number order)."""
    lines = (RESULTS / name).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return sorted(records, key=lambda r: r["params"].get("seed", 0))


def bounded_interval(values: list[float]) -> tuple[str, float, float, float]:
    """(scale, centre, lo, hi): a t interval on the logit (or log) scale, mapped back."""
    if all(0.0 < v < 1.0 for v in values):
        scale = "logit"
    elif all(v > 0.0 for v in values):
        scale = "log"
    else:
        raise ValueError(f"no bounded scale for {values}")

    def fwd(v: float) -> float:
        return math.log(v / (1 - v)) if scale == "logit" else math.log(v)

    def back(x: float) -> float:
        return 1 / (1 + math.exp(-x)) if scale == "logit" else math.exp(x)

    z = [fwd(v) for v in values]
    n = len(z)
    mean = sum(z) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in z) / (n - 1))
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return scale, back(mean), back(mean - half), back(mean + half)


def _show(label: str, values: list[float]) -> None:
    scale, c, lo, hi = bounded_interval(values)
    raw = ", ".join(f"{v:.3g}" for v in values)
    print(f"{label:40s} {c:.3g} [{lo:.3g}, {hi:.3g}] ({scale}; seeds: {raw})")


def main() -> None:
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in _load("rank_collapse_variants.jsonl"):
        p = r["params"]
        groups[(p["model.block"], p["model.n_layers"])].append(r["summary"]["init_rank_ratio"])
    print("4.1 init_rank_ratio (last layer, step 0)")
    for (block, depth), vals in sorted(groups.items()):
        _show(f"  {block} L={depth}", vals)

    ent: dict[tuple[float, str, float], list[float]] = defaultdict(list)
    for r in _load("entropy_collapse.jsonl"):
        p = r["params"]
        key = (p["optim.lr"], p["model.qk_norm"], p["regularizer.lambda"])
        ent[key].append(r["summary"]["min_norm_entropy"])
    print("4.3 min_norm_entropy (final)")
    for key, vals in sorted(ent.items()):
        _show(f"  lr {key[0]} {key[1]} lambda {key[2]}", vals)

    loc: dict[float, list[dict[str, Any]]] = defaultdict(list)
    for r in _load("localization_v2.jsonl"):
        loc[r["params"]["regularizer.lambda"]].append(r["summary"])
    print("4.2 (final)")
    for lam, summaries in sorted(loc.items()):
        for field in ("min_norm_entropy", "final_rank_ratio"):
            _show(f"  lambda {lam} {field}", [s[field] for s in summaries])

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
        _, p_two = stats.fisher_exact(table, alternative="two-sided")
        _, p_one = stats.fisher_exact(table, alternative="greater")
        print(
            f"  lr {key[0]} {key[1]} lambda {key[2]}: {sum(flags)} of {len(flags)}, "
            f"two-sided p = {p_two:.3f}, one-sided p = {p_one:.3f}"
        )


if __name__ == "__main__":
    main()
