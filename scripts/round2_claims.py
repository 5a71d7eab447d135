"""Every interval the claims table of docs/reproductions.md quotes for rounds 1 and 2 that no
other script prints, from the second round's records (docs/results/archive/*.jsonl), with the
interval code of scripts/intervals.py (t quantiles of the sample's df, fixed scale per
quantity, pairing by seed).

    python scripts/round2_claims.py
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import SCALE_OF, paired_diffs, scaled_interval, t_interval  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "archive"  # round 2
Cells = dict[tuple[Any, ...], dict[int, dict[str, Any]]]


def cells(name: str, *keys: str) -> Cells:
    out: Cells = defaultdict(dict)
    for line in (RESULTS / name).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            assert r["state"] == "COMPLETE", r
            out[tuple(r["params"][k] for k in keys)][int(r["params"]["seed"])] = r["summary"]
    return out


def field(c: dict[int, dict[str, Any]], f: str) -> dict[int, float]:
    return {s: float(x[f]) for s, x in c.items()}


def ratio(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], f: str) -> str:
    iv = t_interval(paired_diffs(field(a, f), field(b, f), "log"))
    return f"x{math.exp(iv.centre):.3g} [x{math.exp(iv.lo):.3g}, x{math.exp(iv.hi):.3g}]"


def main() -> None:
    n = 0
    rc = cells("rank_collapse.jsonl", "model.skip", "model.mlp", "model.n_layers")
    print("section 1 (Pre-LN, 200 steps, 3 seeds): attention + MLP / pure attention, init ratio, "
          "paired by seed (log scale)")  # fmt: skip
    for d in sorted({k[2] for k in rc}):
        print(f"  L={d}: {ratio(rc[(False, True, d)], rc[(False, False, d)], 'init_rank_ratio')}")
        n += 1
    skips = [x for k, c in rc.items() if k[0] for x in c.values()]
    print(f"  skip trials: {len(skips)}, final_rank_ratio >= "
          f"{min(x['final_rank_ratio'] for x in skips):.3f}")  # fmt: skip
    for label, key in (("attn+skip", (True, False, 12)), ("full", (True, True, 12))):
        iv = scaled_interval(list(field(rc[key], "final_rank_ratio").values()), "log")
        print(f"  12 layers, step 200, {label}: {iv.fmt()} (log scale)")
        n += 1

    var = cells("rank_collapse_variants.jsonl", "model.block", "model.n_layers")
    print("\nsection 4.1 (Post-LN): attention-skip trials (attn_skip, full) at 4+ layers after "
          "100 steps, and attn_mlp_skip (an MLP skip only)")  # fmt: skip
    for blocks in (("attn_skip", "full"), ("attn_mlp_skip",)):
        xs = [x["final_rank_ratio"] for (b, d), c in var.items() if b in blocks and d >= 4
              for x in c.values()]  # fmt: skip
        below = sum(v < 0.05 for v in xs)
        print(f"  {'/'.join(blocks)}: {below} of {len(xs)} below 0.05, largest {max(xs):.3g}")
    pure = {d: var[("pure", d)] for d in (1, 12)}
    for d in (1, 12):
        iv = scaled_interval(list(field(pure[d], "init_rank_ratio").values()), "log")
        print(f"  pure, init, L={d}: {iv.fmt()} (log)")
        n += 1
    print(f"  12 vs 1 layers, pure, init, paired: {ratio(pure[12], pure[1], 'init_rank_ratio')}")
    n += 1

    ec = cells("entropy_collapse.jsonl", "optim.lr", "model.qk_norm", "regularizer.lambda")
    hi, lo = ec[(0.03, "none", 0.0)], ec[(0.001, "none", 0.0)]
    d = paired_diffs(field(hi, "min_norm_entropy"), field(lo, "min_norm_entropy"), "logit")
    print(f"\nsection 4.3: final entropy, lr 0.03 minus lr 0.001 (no remedy), paired, logit: "
          f"{t_interval(d).fmt(lambda v: f'{v:+.2f}')}")  # fmt: skip
    n += 1
    pen = ec[(0.03, "none", 1.0)]
    print("  lr 0.03, none: qk_eig_var lambda 0 "
          f"{sorted(round(v, 3) for v in field(hi, 'qk_eig_var').values())}, lambda 1 "
          f"{sorted(round(v, 4) for v in field(pen, 'qk_eig_var').values())}")  # fmt: skip
    d = paired_diffs(field(pen, "min_norm_entropy"), field(hi, "min_norm_entropy"), "logit")
    print(f"  lambda 1 minus lambda 0 at lr 0.03, final entropy, paired, logit: "
          f"{t_interval(d).fmt(lambda v: f'{v:+.2f}')}")  # fmt: skip
    n += 1

    tm = cells("bao_target_mean.jsonl", "regularizer.lambda", "regularizer.target_mean")
    print("\nsection 4.4 (Post-LN, non-zero mean): how far the mean moved the logits "
          "(qk_eig_mean at lambda 1, target 2)")  # fmt: skip
    print(f"  {sorted(round(v, 3) for v in field(tm[(1.0, 2.0)], 'qk_eig_mean').values())}")
    ever_equal = sum(
        x["min_norm_entropy_ever"] == x["min_norm_entropy"] for c in tm.values() for x in c.values()
    )
    print(f"  trials whose lowest entropy ever is the final one: {ever_equal} of "
          f"{sum(len(c) for c in tm.values())}")  # fmt: skip
    loc = cells("localization.jsonl", "regularizer.lambda", "regularizer.target_mean",
                "model.qk_init_std")  # fmt: skip
    print("\nsection 2 (300 steps, 3 seeds): qk_eig_mean reached at target 2, as a fraction of 2")
    for k, c in sorted(loc.items()):
        if k[1] == 2.0 and k[0] > 0:
            m = t_interval(list(field(c, "qk_eig_mean").values()))
            print(f"  lambda {k[0]:g}, init {k[2]:g}: {m.centre / 2:.2f} of 2")
    print(f"\nintervals printed: {n}; scales: {SCALE_OF['init_rank_ratio']} for rank ratios, "
          f"{SCALE_OF['min_norm_entropy']} for entropy")  # fmt: skip


if __name__ == "__main__":
    main()
