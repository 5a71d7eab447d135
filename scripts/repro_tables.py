"""The tables of docs/reproductions.md sections 1 and 2 (their three-seed reruns) and 4.1-4.3,
from the per-trial records that `scripts/repro_via_service.py` read back through the results
API (docs/results/*.jsonl).

    python scripts/repro_tables.py            # every table, as Markdown
    python scripts/repro_tables.py FILE.jsonl METRIC [METRIC ...]
                                              # any grid: per setting, mean [95 % t] (seeds)

Sections 4.1-4.3: cells are the mean over seeds with a 95 % Student-t interval on the raw
values; the bounded (logit / log scale) intervals quoted in the verdicts come from
scripts/bounded_intervals.py. Sections 1 and 2 (rank_collapse.jsonl, localization.jsonl):
ratios in (0, 1) (rank ratio, normalised entropy) get the t interval on the logit scale,
eigen-variance (positive, spanning orders of magnitude) the geometric mean with a t interval
on the log scale, both mapped back (`bounded_interval`), so no interval leaves the range its
quantity lives in; losses keep raw t intervals; comparisons are paired by seed (seeds share
data order and initialisation).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bounded_intervals import bounded_interval  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def load(path: Path) -> list[dict[str, Any]]:
    """The records in seed order (the service's are in trial-number order)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["params"].get("seed", 0))


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and a 95 % Student-t interval (half-width 0 for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def mean_ci(values: list[float]) -> str:
    m, lo, hi = interval(values)
    return f"{m:.3g} [{lo:.3g}, {hi:.3g}]"


def seeds(values: list[float]) -> str:
    return ", ".join(f"{v:.3g}" for v in values)


def by(records: list[dict[str, Any]], *paths: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Summaries grouped by the given params, each group in seed order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        assert r["state"] == "COMPLETE", r
        groups[tuple(r["params"][p] for p in paths)].append(r["summary"])
    return groups


# ---- sections 1 and 2: the three-seed reruns ----------------------------------------------


def sig(v: float, digits: int = 2) -> str:
    """`digits` significant figures, trailing zeros kept; below 1e-3 as 1.2e-4."""
    if v != 0.0 and abs(v) < 1e-3:
        mant, exp = f"{v:.{digits - 1}e}".split("e")
        return f"{mant}e{int(exp)}"
    return f"{v:#.{digits}g}".rstrip(".")


def bounded_ci(values: list[float], digits: int = 2, decimals: int | None = None) -> str:
    """Centre [95 %] on the logit scale for values in (0, 1), else on the log scale; with
    `decimals`, fixed-point (entropies near 1), else `digits` significant figures."""
    _, c, lo, hi = bounded_interval(values)

    def f(v: float) -> str:
        return sig(v, digits) if decimals is None else f"{v:.{decimals}f}"

    return f"{f(c)} [{f(lo)}, {f(hi)}]"


def logit(v: float) -> float:
    return math.log(v / (1 - v))


def rank_collapse_seeds() -> None:
    """Section 1, three seeds (rank_collapse.jsonl): last-layer rank ratio on the logit
    scale at step 0 and 200, validation loss, and the numbers its verdicts quote."""
    recs = load(RESULTS / "rank_collapse.jsonl")
    g = by(recs, "model.skip", "model.mlp", "model.n_layers")
    depths = sorted({d for _, _, d in g})
    variants = [
        ("pure attention", False, False),
        ("attention + MLP", False, True),
        ("attention + skip", True, False),
        ("full transformer", True, True),
    ]
    print("\n1 (three seeds): last-layer rank ratio, mean [95 %] on the logit scale\n")
    print("| variant | step | " + " | ".join(f"L={d}" for d in depths) + " |")
    print("|---|---|" + "---|" * len(depths))
    for name, skip, mlp in variants:
        for step, field in ((0, "init_rank_ratio"), (200, "final_rank_ratio")):
            cells = [bounded_ci([x[field] for x in g[(skip, mlp, d)]]) for d in depths]
            print(f"| {name} | {step} | " + " | ".join(cells) + " |")
    print("\nvalidation loss after 200 steps, mean [95 % t]")
    for name, skip, mlp in variants:
        cells = []
        for d in depths:
            m, lo, hi = interval([x["final_val_loss"] for x in g[(skip, mlp, d)]])
            cells.append(f"L={d} {m:.3f} [{lo:.3f}, {hi:.3f}]")
        print(f"  {name}: " + ", ".join(cells))
    skips = [r["summary"] for r in recs if r["params"]["model.skip"]]
    collapsed = [
        r["summary"]
        for r in recs
        if not r["params"]["model.skip"] and r["params"]["model.n_layers"] >= 3
    ]
    print(
        f"{len(skips)} skip trials: init_rank_ratio >= "
        f"{min(x['init_rank_ratio'] for x in skips):.3f}, final_rank_ratio >= "
        f"{min(x['final_rank_ratio'] for x in skips):.3f},"
        f" final_val_loss <= {max(x['final_val_loss'] for x in skips):.3f}"
    )
    losses = [x["final_val_loss"] for x in collapsed]
    print(
        f"{len(collapsed)} no-skip trials at 3+ layers: final_val_loss "
        f"{min(losses):.3f}-{max(losses):.3f}, final_rank_ratio "
        f"<= {sig(max(x['final_rank_ratio'] for x in collapsed))}"
    )


def localization_seeds() -> None:
    """Section 2's study 2, three seeds, v2 (localization.jsonl): per cell, and paired by seed
    against lambda 0 at the same target mean and QK init."""
    g = by(
        load(RESULTS / "localization.jsonl"),
        "regularizer.lambda",
        "regularizer.target_mean",
        "model.qk_init_std",
    )
    same = ("final_val_loss", "val_losses", "qk_eig_var", "min_norm_entropy", "final_rank_ratio")
    for (lam, t, init), s in g.items():  # lambda 0: the target is inert, the trainings equal
        if lam == 0.0:
            other = g[(lam, 2.0 - t, init)]
            assert all(a[f] == b[f] for a, b in zip(s, other, strict=True) for f in same)
    print(
        "\n2 (three seeds, v2): eig. var geometric mean [95 %, log scale]; entropy and rank"
        " ratio [95 %, logit scale]; loss [95 % t]\n"
    )
    print(
        "| lambda | target mean | QK init | eig. var | eig. mean | attn. entropy | val. loss"
        " | val. ppl | rank ratio |\n|---|---|---|---|---|---|---|---|---|"
    )
    for (lam, t, init), s in sorted(g.items()):
        if lam == 0.0 and t != 0.0:
            continue
        loss = [x["final_val_loss"] for x in s]
        m, lo, hi = interval(loss)
        print(
            f"| {lam:g} | {'(any)' if lam == 0.0 else f'{t:g}'} | {init:g} "
            f"| {bounded_ci([x['qk_eig_var'] for x in s], 3)} "
            f"| {statistics.fmean(x['qk_eig_mean'] for x in s):.3f} "
            f"| {bounded_ci([x['min_norm_entropy'] for x in s], decimals=3)} "
            f"| {m:.4f} [{lo:.4f}, {hi:.4f}] | {math.exp(m):.1f} "
            f"| {bounded_ci([x['final_rank_ratio'] for x in s], decimals=3)} |"
        )
    print("\npaired by seed vs lambda 0 (same target mean and QK init), mean [95 % t]:")
    for (lam, t, init), s in sorted(g.items()):
        if lam == 0.0:
            continue
        base = g[(0.0, t, init)]
        pairs = list(zip(s, base, strict=True))
        ent = [logit(a["min_norm_entropy"]) - logit(b["min_norm_entropy"]) for a, b in pairs]
        dl = [a["final_val_loss"] - b["final_val_loss"] for a, b in pairs]
        em, elo, ehi = interval(ent)
        lm, llo, lhi = interval(dl)
        print(
            f"  lambda {lam:g}, target {t:g}, init {init:g}: entropy (logit) "
            f"{em:+.2f} [{elo:+.2f}, {ehi:+.2f}]; val. loss {lm:+.4f} [{llo:+.4f}, {lhi:+.4f}]"
            f" ({seeds(dl)})"
        )


def rank_collapse() -> None:
    g = by(load(RESULTS / "rank_collapse_variants.jsonl"), "model.block", "model.n_layers")
    depths = sorted({d for _, d in g})
    blocks = ["pure", "attn_mlp", "attn_mlp_skip", "attn_skip", "full"]
    head = "| variant | " + " | ".join(f"L={d}" for d in depths) + " |"
    rule = "|---|" + "---|" * len(depths)
    for title, cell in (
        ("init_rank_ratio, mean [95 % t]", lambda s: mean_ci([x["init_rank_ratio"] for x in s])),
        ("final_rank_ratio, seeds 0, 1, 2", lambda s: seeds([x["final_rank_ratio"] for x in s])),
        ("final_val_loss, mean [95 % t]", lambda s: mean_ci([x["final_val_loss"] for x in s])),
    ):
        print(f"\n4.1 {title}\n\n{head}\n{rule}")
        for b in blocks:
            print(f"| {b} | " + " | ".join(cell(g[(b, d)]) for d in depths) + " |")
    # "doubly exponential": the per-seed fall of log init_rank_ratio per layer (pure attention)
    # from 1 to 8 and from 8 to 12 layers; doubly exponential decay would triple it per layer
    log_r = {d: [math.log(x["init_rank_ratio"]) for x in g[("pure", d)]] for d in (1, 8, 12)}
    lo_fall = [(a - b) / 7 for a, b in zip(log_r[1], log_r[8], strict=True)]
    hi_fall = [(a - b) / 4 for a, b in zip(log_r[8], log_r[12], strict=True)]
    print("\n4.1 pure attention, fall of log init_rank_ratio per layer, mean [95 % t] (seeds)")
    for label, xs in (
        ("1-8 layers", lo_fall),
        ("8-12 layers", hi_fall),
        ("8-12 minus 1-8, paired", [b - a for a, b in zip(lo_fall, hi_fall, strict=True)]),
    ):
        m, lo, hi = interval(xs)
        print(f"  {label}: {m:.2f} [{lo:.2f}, {hi:.2f}] ({seeds(xs)})")


def entropy_collapse() -> None:
    recs = load(RESULTS / "entropy_collapse.jsonl")
    g = by(recs, "optim.lr", "model.qk_norm", "regularizer.lambda")
    print(
        "\n4.3\n\n| lr | QK norm | lambda | final min. entropy (seeds) | lowest ever (seeds) |"
        " entropy collapse | val. loss |\n|---|---|---|---|---|---|---|"
    )
    for (lr, norm, lam), s in sorted(g.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        final = [x["min_norm_entropy"] for x in s]
        ever = [x["min_norm_entropy_ever"] for x in s]
        n = sum(x["entropy_collapse"] for x in s)
        loss = mean_ci([x["final_val_loss"] for x in s])
        print(
            f"| {lr:g} | {norm} | {lam:g} | {seeds(final)} | {seeds(ever)} | {n} of {len(s)}"
            f" | {loss} |"
        )
    diverged = [r for r in recs if r["summary"]["diverged_at_step"] is not None]
    print(f"\ndiverged: {len(diverged)}")


def localization() -> None:
    g = by(load(RESULTS / "localization_v2.jsonl"), "regularizer.lambda")
    print(
        "\n4.2\n\n| lambda | eig. var | eig. mean | entropy | val. loss (seeds) | val. ppl |"
        " rank ratio |\n|---|---|---|---|---|---|---|"
    )
    for (lam,), s in sorted(g.items()):
        var = [x["qk_eig_var"] for x in s]
        loss = [x["final_val_loss"] for x in s]
        print(
            f"| {lam:g} | {mean_ci(var)} ({seeds(var)}) "
            f"| {statistics.fmean(x['qk_eig_mean'] for x in s):.2g} "
            f"| {mean_ci([x['min_norm_entropy'] for x in s])} "
            f"| {mean_ci(loss)} ({', '.join(f'{v:.4f}' for v in loss)}) "
            f"| {math.exp(statistics.fmean(loss)):.2f} "
            f"| {mean_ci([x['final_rank_ratio'] for x in s])} |"
        )
    zero = {i: x["final_val_loss"] for i, x in enumerate(g[(0.0,)])}
    for (lam,), s in sorted(g.items()):
        if lam:
            diffs = [x["final_val_loss"] - zero[i] for i, x in enumerate(s)]
            m, lo, hi = interval(diffs)
            print(
                f"paired loss, lambda {lam:g} - 0: {seeds(diffs)}; {m:+.4f} [{lo:+.4f}, {hi:+.4f}]"
            )


def any_grid(path: str, metrics: list[str]) -> None:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in load(Path(path)):
        key = json.dumps({k: v for k, v in rec["params"].items() if k != "seed"}, sort_keys=True)
        groups[key].append(rec["summary"])
    for key, summaries in groups.items():
        cells = []
        for m in metrics:
            xs = [float(s[m]) for s in summaries if s.get(m) is not None]
            cells.append(f"{m}: {mean_ci(xs)} ({seeds(xs)})" if xs else f"{m}: n/a")
        print(key, "|", " | ".join(cells))


def main(argv: list[str]) -> None:
    if argv:
        any_grid(argv[0], argv[1:])
        return
    rank_collapse_seeds()
    localization_seeds()
    rank_collapse()
    localization()
    entropy_collapse()


if __name__ == "__main__":
    main(sys.argv[1:])
