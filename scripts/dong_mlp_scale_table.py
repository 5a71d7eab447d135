"""Intervals for docs/reproductions.md section 4.5 (Dong et al., MLPs far from the identity).

Reads docs/results/archive/dong_mlp_scale.jsonl (study 1 of the 2026-11-25 service run, 54 trials:
model.block {pure, attn_mlp, attn_mlp_skip} x model.mlp_init_std {0.02, 0.125, 0.5} x
model.n_layers {8, 12} x seed {0, 1, 2}) and prints:

1. the `pure` check: pure has no MLP, so its three mlp_init_std cells are the same three
   trainings per depth. Which fields coincide exactly, and how far the others are apart.
2. per (block, depth, mlp_init_std): init_rank_ratio and final_rank_ratio (last layer), the
   geometric mean over seeds 0, 1, 2 with a 95 % Student-t interval on the log scale (t = 4.30),
   mapped back, and the three seeds; final_val_loss (raw t interval).
3. paired by seed, as a ratio (exp of the mean per-seed log-ratio, t interval on the logs):
   each MLP cell against pure at the same depth and seed (pure = its mlp_init_std 0.02 cell),
   and, within a block, mlp_init_std 0.125 and 0.5 against 0.02 at the same depth and seed;
4. the mlp_init_std 0.02 cells (the section 4.1 configurations) against section 4.1's records
   (rank_collapse_variants.jsonl, also read back from the service, where its 8- and 12-layer
   trials ran in one-slot workers, unfused): the fused run should match them to float32
   rounding.

What a pairing shares (checked by building the models). One torch seed draws every weight;
the MLP weights take `mlp_init_std` in the same draws. So within a block the seeds pair across
mlp_init_std exactly: the same data order, probe batch and weights, the MLP weights the same
draws scaled (attn_mlp and attn_mlp_skip even get identical weights). Against pure, a seed
shares data order and probe batch (generators of their own) but no weight: constructing the
MLP layers consumes random numbers, so every weight of pure is a different draw.

Run: python scripts/dong_mlp_scale_table.py
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounded_intervals import RESULTS  # noqa: E402
from paired_intervals import log_interval, t_interval  # noqa: E402

BLOCKS = ("pure", "attn_mlp", "attn_mlp_skip")
STDS = (0.02, 0.125, 0.5)
DEPTHS = (8, 12)
SEEDS = (0, 1, 2)
RATIOS = ("init_rank_ratio", "final_rank_ratio")
FLOOR = 1e-6  # float32 round-off relative to the layer output sits at ~1.5e-7 (section 1)

Cells = dict[tuple[str, int, float], dict[int, dict[str, Any]]]


def load() -> Cells:
    cells: Cells = defaultdict(dict)
    for line in (RESULTS / "dong_mlp_scale.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        assert r["state"] == "COMPLETE", r
        p = r["params"]
        key = (p["model.block"], p["model.n_layers"], p["model.mlp_init_std"])
        assert p["seed"] not in cells[key], r
        cells[key][p["seed"]] = r["summary"]
    assert len(cells) == 18 and all(len(v) == 3 for v in cells.values())
    return cells


def g(x: float) -> str:
    return f"{x:.3g}"


def ratio_line(label: str, vals: list[float]) -> str:
    c, lo, hi = log_interval(vals)
    seeds = ", ".join(g(v) for v in vals)
    return f"  {label:18s} {g(c)} [{g(lo)}, {g(hi)}] (seeds {seeds})"


def paired_ratio(a: list[float], b: list[float]) -> str:
    d = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    m, lo, hi = t_interval(d)
    seeds = ", ".join(f"{v:+.2f}" for v in d)
    return (
        f"x{math.exp(m):.3g} [x{math.exp(lo):.3g}, x{math.exp(hi):.3g}]"
        f"  (log {m:+.2f} [{lo:+.2f}, {hi:+.2f}]; per seed {seeds})"
    )


def main() -> None:
    cells = load()

    print("1. pure: the three mlp_init_std cells per depth and seed")
    for depth in DEPTHS:
        for s in SEEDS:
            runs = [cells[("pure", depth, std)][s] for std in STDS]
            same = [
                f
                for f in ("init_rank_ratio", "init_val_loss", "init_min_norm_entropy")
                if len({r[f] for r in runs}) == 1
            ]
            fr = [r["final_rank_ratio"] for r in runs]
            fl = [r["final_val_loss"] for r in runs]
            print(
                f"  L={depth} seed {s}: identical {same}; final_rank_ratio "
                f"{', '.join(g(v) for v in fr)} (max/min {max(fr) / min(fr):.3f}); "
                f"final_val_loss spread {max(fl) - min(fl):.2e}"
            )

    print("\n2. per cell: geometric mean [95 % interval, log scale] over seeds 0, 1, 2")
    for block in BLOCKS:
        for depth in DEPTHS:
            for std in STDS if block != "pure" else (0.02,):
                by = cells[(block, depth, std)]
                print(f"{block} L={depth} mlp_init_std {std}")
                for f in RATIOS:
                    vals = [by[s][f] for s in SEEDS]
                    floor = sum(v < FLOOR for v in vals)
                    note = f"  [{floor} of 3 below {FLOOR:g}]" if floor else ""
                    print(ratio_line(f, vals) + note)
                loss = [by[s]["final_val_loss"] for s in SEEDS]
                m, lo, hi = t_interval(loss)
                seeds = ", ".join(f"{v:.4f}" for v in loss)
                print(f"  {'final_val_loss':18s} {m:.4f} [{lo:.4f}, {hi:.4f}] (seeds {seeds})")

    print("\n3a. paired by seed: MLP variant / pure (pure = its 0.02 cell), same depth and seed")
    for f in RATIOS:
        print(f)
        for block in BLOCKS[1:]:
            for depth in DEPTHS:
                for std in STDS:
                    a = [cells[(block, depth, std)][s][f] for s in SEEDS]
                    b = [cells[("pure", depth, 0.02)][s][f] for s in SEEDS]
                    print(f"  {block:13s} L={depth:<2d} std {std:<5g} / pure: {paired_ratio(a, b)}")

    print("\n3b. paired by seed within a block: mlp_init_std X / 0.02, same depth and seed")
    for f in RATIOS:
        print(f)
        for block in BLOCKS[1:]:
            for depth in DEPTHS:
                for std in STDS[1:]:
                    a = [cells[(block, depth, std)][s][f] for s in SEEDS]
                    b = [cells[(block, depth, 0.02)][s][f] for s in SEEDS]
                    print(f"  {block:13s} L={depth:<2d} {std:<5g} / 0.02: {paired_ratio(a, b)}")

    print(
        "\n4. the mlp_init_std 0.02 cells against section 4.1's records "
        "(rank_collapse_variants.jsonl, through the service, 8 and 12 layers in one-slot workers)"
    )
    alone: dict[tuple[str, int, int], dict[str, Any]] = {}
    for line in (RESULTS / "rank_collapse_variants.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            p = r["params"]
            alone[(p["model.block"], p["model.n_layers"], p["seed"])] = r["summary"]
    same_init, worst, worst_init = 0, 0.0, 0.0
    for block in BLOCKS:
        for depth in DEPTHS:
            for s in SEEDS:
                a, b = cells[(block, depth, 0.02)][s], alone[(block, depth, s)]
                same_init += a["init_rank_ratio"] == b["init_rank_ratio"]
                rel = abs(a["init_rank_ratio"] - b["init_rank_ratio"]) / b["init_rank_ratio"]
                worst_init = max(worst_init, rel)
                dl = [abs(x - y) for x, y in zip(a["val_losses"], b["val_losses"], strict=True)]
                if max(dl) > 1e-4:
                    print(
                        f"  {block} L={depth} seed {s}: val_losses fused "
                        f"{[round(v, 5) for v in a['val_losses']]} vs one slot "
                        f"{[round(v, 5) for v in b['val_losses']]} (steps {a['eval_steps']})"
                    )
                else:
                    worst = max(worst, max(dl))
    print(
        f"  init_rank_ratio bit-identical in {same_init} of 18, all within {worst_init:.2g} "
        f"relative; the other trials' val_losses agree to {worst:.2g}"
    )

    final = [r[s]["final_rank_ratio"] for r in cells.values() for s in SEEDS]
    print(
        f"\nfinal_rank_ratio over all 54 trials: max {g(max(final))}, "
        f"{sum(v < FLOOR for v in final)} of 54 below {FLOOR:g}, "
        f"{sum(v < 0.05 for v in final)} of 54 below the collapse threshold 0.05"
    )


if __name__ == "__main__":
    main()
