"""The tables of docs/reproductions.md sections 1 and 2 (their three-seed reruns) and 4.1-4.3,
from the per-trial records that `scripts/repro_via_service.py` read back through the results
API (docs/results/archive/*.jsonl).

    python scripts/repro_tables.py            # every table, as Markdown
    python scripts/repro_tables.py FILE.jsonl METRIC [METRIC ...]
                                              # any grid: per setting, mean [95 % t] (seeds)

Sections 4.1-4.3: cells are the mean over seeds with a 95 % Student-t interval on the raw
values; the bounded intervals quoted in the verdicts come from scripts/bounded_intervals.py.
Sections 1 and 2 (rank_collapse.jsonl, localization.jsonl): each quantity on its own fixed
scale (scripts/intervals.py): normalised entropy on the logit scale, rank ratio and
eigen-variance (positive, spanning orders of magnitude; the rank ratio is not bounded by 1)
on the log scale (geometric mean), mapped back; losses raw. t quantiles of the sample's own
df; comparisons are paired by seed, matched by the seed itself (seeds share data order and
initialisation).
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
from intervals import SCALE_OF, paired_diffs, t_interval  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "archive"  # round 2


def load(path: Path) -> list[dict[str, Any]]:
    """The records in seed order (the service's are in trial-number order)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["params"].get("seed", 0))


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and a 95 % Student-t interval, the t quantile of its own df (half-width 0 for one
    value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    iv = t_interval(values)
    return iv.centre, iv.lo, iv.hi


def mean_ci(values: list[float]) -> str:
    m, lo, hi = interval(values)
    return f"{m:.3g} [{lo:.3g}, {hi:.3g}]"


def seeds(values: list[float]) -> str:
    return ", ".join(f"{v:.3g}" for v in values)


def by(records: list[dict[str, Any]], *paths: str) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Summaries grouped by the given params, each group in seed order (for per-cell
    statistics; comparisons pair by seed through `by_seed`)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        assert r["state"] == "COMPLETE", r
        groups[tuple(r["params"][p] for p in paths)].append(r["summary"])
    return groups


def by_seed(
    records: list[dict[str, Any]], *paths: str
) -> dict[tuple[Any, ...], dict[int, dict[str, Any]]]:
    """Summaries grouped by the given params, then keyed by seed: what paired comparisons
    match on (never list position)."""
    groups: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        assert r["state"] == "COMPLETE", r
        groups[tuple(r["params"][p] for p in paths)][int(r["params"].get("seed", 0))] = r["summary"]
    return groups


def paired(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], field: str, scale: str = "raw"
) -> list[float]:
    """Per-seed differences a - b of one summary field, matched by seed."""
    return paired_diffs(
        {s: x[field] for s, x in a.items()},
        {s: x[field] for s, x in b.items()},
        scale,  # type: ignore[arg-type]
    )


# ---- sections 1 and 2: the three-seed reruns ----------------------------------------------


def sig(v: float, digits: int = 2) -> str:
    """`digits` significant figures, trailing zeros kept; below 1e-3 as 1.2e-4."""
    if v != 0.0 and abs(v) < 1e-3:
        mant, exp = f"{v:.{digits - 1}e}".split("e")
        return f"{mant}e{int(exp)}"
    return f"{v:#.{digits}g}".rstrip(".")


def bounded_ci(
    values: list[float], quantity: str, digits: int = 2, decimals: int | None = None
) -> str:
    """Centre [95 %] on the quantity's own fixed scale (logit for normalised entropy, log for
    rank ratio and eigen-variance: scripts/intervals.py); with `decimals`, fixed-point
    (entropies near 1), else `digits` significant figures."""
    _, c, lo, hi = bounded_interval(values, SCALE_OF[quantity])

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
    print("\n1 (three seeds): last-layer rank ratio, geometric mean [95 %] on the log scale\n")
    print("| variant | step | " + " | ".join(f"L={d}" for d in depths) + " |")
    print("|---|---|" + "---|" * len(depths))
    for name, skip, mlp in variants:
        for step, field in ((0, "init_rank_ratio"), (200, "final_rank_ratio")):
            cells = [bounded_ci([x[field] for x in g[(skip, mlp, d)]], field) for d in depths]
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
        "\n2 (three seeds, v2): eig. var and rank ratio geometric mean [95 %, log scale];"
        " entropy [95 %, logit scale]; loss [95 % t]\n"
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
            f"| {bounded_ci([x['qk_eig_var'] for x in s], 'qk_eig_var', 3)} "
            f"| {statistics.fmean(x['qk_eig_mean'] for x in s):.3f} "
            f"| {bounded_ci([x['min_norm_entropy'] for x in s], 'min_norm_entropy', decimals=3)} "
            f"| {m:.4f} [{lo:.4f}, {hi:.4f}] | {math.exp(m):.1f} "
            f"| {bounded_ci([x['final_rank_ratio'] for x in s], 'final_rank_ratio', decimals=3)} |"
        )
    print("\npaired by seed vs lambda 0 (same target mean and QK init), mean [95 % t]:")
    gs = by_seed(
        load(RESULTS / "localization.jsonl"),
        "regularizer.lambda",
        "regularizer.target_mean",
        "model.qk_init_std",
    )
    for (lam, t, init), cell in sorted(gs.items()):
        if lam == 0.0:
            continue
        base = gs[(0.0, t, init)]
        ent = paired(cell, base, "min_norm_entropy", "logit")
        dl = paired(cell, base, "final_val_loss")
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
    # The "doubly exponential" statistic that stood here compared the last-layer ratios of
    # separately initialised models of different depth; the rate is read inside one model,
    # layer by layer (docs/metrics.md section 8): scripts/dong_rate.py, section 5.1.


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
    gs = by_seed(load(RESULTS / "localization_v2.jsonl"), "regularizer.lambda")
    for (lam,), cell in sorted(gs.items()):
        if lam:
            diffs = paired(cell, gs[(0.0,)], "final_val_loss")
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
