"""The tables of docs/reproductions.md sections 4.1-4.3, from the per-trial records that
`scripts/repro_via_service.py` read back through the results API (docs/results/*.jsonl).

    python scripts/repro_tables.py            # every table, as Markdown
    python scripts/repro_tables.py FILE.jsonl METRIC [METRIC ...]
                                              # any grid: per setting, mean [95 % t] (seeds)

Cells are the mean over seeds with a 95 % Student-t interval on the raw values; the bounded
(logit / log scale) intervals quoted in the verdicts come from scripts/bounded_intervals.py.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

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
    rank_collapse()
    localization()
    entropy_collapse()


if __name__ == "__main__":
    main(sys.argv[1:])
