"""Intervals for docs/reproductions.md section 4.4 (Bao et al., non-zero target mean, v2).

Reads docs/results/archive/bao_target_mean.jsonl (study 1 of the service run, 18 trials:
regularizer.lambda {0, 0.1, 1} x regularizer.target_mean {0, 2} x seed {0, 1, 2}) and prints,
per (lambda, target mean), mean [95 % interval] over the three seeds:

- qk_eig_var: Student-t on the raw values, and on the log scale (geometric mean) where the raw
  interval runs below 0;
- qk_eig_mean, final_val_loss: Student-t on the raw values;
- min_norm_entropy, min_norm_entropy_ever: t interval on the logit scale; final_rank_ratio: on
  the log scale (fixed per quantity, scripts/intervals.py), mapped back;

then paired-by-seed differences (seeds share data order and initialisation), Student-t on
the per-seed differences: target 2 minus target 0 at the same lambda, and each penalised cell
minus the lambda = 0 baseline. With lambda = 0 the target is inert, so the lambda = 0 trials
with target 0 and 2 are the same training: the script checks they are bit-identical and uses
them as one baseline of three seeds. Run: python scripts/paired_intervals.py
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounded_intervals import RESULTS, bounded_interval  # noqa: E402
from intervals import SCALE_OF, paired_diffs, t_quantile  # noqa: E402

FIELDS = (
    "qk_eig_var",
    "qk_eig_mean",
    "min_norm_entropy",
    "min_norm_entropy_ever",
    "final_rank_ratio",
    "final_val_loss",
)
BOUNDED = ("min_norm_entropy", "min_norm_entropy_ever", "final_rank_ratio")
SEEDS = (0, 1, 2)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def log_interval(values: list[float]) -> tuple[float, float, float]:
    m, lo, hi = t_interval([math.log(v) for v in values])
    return math.exp(m), math.exp(lo), math.exp(hi)


def fmt(x: float) -> str:
    return f"{x:.4g}"


def load() -> dict[tuple[float, float], dict[int, dict[str, Any]]]:
    cells: dict[tuple[float, float], dict[int, dict[str, Any]]] = defaultdict(dict)
    for line in (RESULTS / "bao_target_mean.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        assert r["state"] == "COMPLETE", r
        p = r["params"]
        key = (p["regularizer.lambda"], p["regularizer.target_mean"])
        cells[key][p["seed"]] = r["summary"]
    return cells


def main() -> None:
    cells = load()
    # lambda 0: the target is inert; the two target values must be the same training
    for s in SEEDS:
        a, b = cells[(0.0, 0.0)][s], cells[(0.0, 2.0)][s]
        same = all(a[f] == b[f] for f in FIELDS) and a["val_losses"] == b["val_losses"]
        print(f"lambda 0, seed {s}: target 0 and target 2 bit-identical: {same}")
    base = cells[(0.0, 0.0)]
    groups = {"baseline (lambda 0)": base}
    for lam in (0.1, 1.0):
        for t in (0.0, 2.0):
            groups[f"lambda {lam:g}, target {t:g}"] = cells[(lam, t)]

    print("\nper cell: mean [95 % interval] (seeds 0, 1, 2)")
    for name, by_seed in groups.items():
        print(name)
        for f in FIELDS:
            vals = [by_seed[s][f] for s in SEEDS]
            seeds = ", ".join(fmt(v) for v in vals)
            if f in BOUNDED:
                scale, c, lo, hi = bounded_interval(vals, SCALE_OF[f])
                print(f"  {f:22s} {fmt(c)} [{fmt(lo)}, {fmt(hi)}] ({scale}; {seeds})")
                continue
            m, lo, hi = t_interval(vals)
            extra = ""
            if f == "qk_eig_var":
                g, glo, ghi = log_interval(vals)
                extra = f"  log scale: {fmt(g)} [{fmt(glo)}, {fmt(ghi)}]"
            print(f"  {f:22s} {fmt(m)} [{fmt(lo)}, {fmt(hi)}] ({seeds}){extra}")

    def paired(label: str, a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> None:
        print(label)
        for f in (
            "min_norm_entropy",
            "min_norm_entropy_ever",
            "final_rank_ratio",
            "final_val_loss",
            "qk_eig_var",
        ):
            d = [a[s][f] - b[s][f] for s in SEEDS]
            m, lo, hi = t_interval(d)
            seeds = ", ".join(f"{v:+.4f}" for v in d)
            line = f"  d {f:22s} {m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({seeds})"
            if f in BOUNDED:  # the same difference on the quantity's own scale
                scale = SCALE_OF[f]
                fa = {s: a[s][f] for s in SEEDS}
                fb = {s: b[s][f] for s in SEEDS}
                lm, llo, lhi = t_interval(paired_diffs(fa, fb, scale))
                line += f"  {scale}: {lm:+.3f} [{llo:+.3f}, {lhi:+.3f}]"
            print(line)

    print("\npaired by seed, mean [95 % interval] (per-seed differences)")
    for lam in (0.1, 1.0):
        paired(f"lambda {lam:g}: target 2 - target 0", cells[(lam, 2.0)], cells[(lam, 0.0)])
    for lam in (0.1, 1.0):
        for t in (0.0, 2.0):
            paired(f"lambda {lam:g}, target {t:g} - baseline", cells[(lam, t)], base)


if __name__ == "__main__":
    main()
