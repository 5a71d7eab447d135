"""Dong et al.'s depth rate inside one model (docs/reproductions.md section 5.1), from the
round-3 exports the service produced (docs/results/round3/: the trials CSV and the metric
rows as Parquet of each study, downloaded over REST by scripts/repro_via_service.py).

    python scripts/dong_rate.py            # every table of section 5.1, as Markdown

Per trial and evaluation (step 0: as initialised; the last step: after training), r_l is the
stored `rank_ratio` of layer l (0 = the embedding, mean over the probe batch) and
y_l = log(-log r_l). The usable layers are those before the first layer at the floor,
r_l <= FLOOR, whose ratio is below 1 (the composite-norm ratio can reach 1.0-1.01 in the odd
layer or embedding, where log(-log r) does not exist: such layers are left out); the last
layer before the floor is k (FLOOR = 1e-13 in float64, about 500 times its round-off floor
of ~2e-16; 1e-5 in float32, whose floor is ~1e-7). Per trial:

- `slope`: the least-squares slope of y_l on l over the usable layers (needs 3 or more);
  Dong et al.'s bound for pure attention makes y_l rise at least linearly with slope log 3
  (about 1.10) where it is not vacuous; a merely exponential fall gives a slope that goes to
  0 as l grows;
- `bend`: the slope over the second half of the usable layers minus the slope over the first
  half (needs 5 or more; the halves share the middle layer): about 0 for a doubly
  exponential fall, negative for an exponential one;
- `reach`: k, the last layer before the floor (24 when the ratio never reaches it).

Per arm (a setting: the seeds are its replicates), the mean over seeds with a 95 % Student-t
interval (scripts/intervals.py) for slope and bend, over the seeds where they are defined
(their count is printed: an arm whose ratio reaches the floor within two layers has no
slope at all).

The statistics above were fixed (and this script committed) before the round-3 studies
finished. Seeing the results added one sensitivity check, printed separately (`--from-layer
1`): the same statistics over layers 1 on, leaving out the embedding. r_0 is about 0.9, where
log(-log r) is steep (it goes to minus infinity as r goes to 1), so the step from layer 0 to
layer 1 inflates the slope and makes the bend negative for any fast decay.
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import t_interval  # noqa: E402

ROUND3 = Path(__file__).resolve().parents[1] / "docs" / "results" / "round3"
FLOOR = {"float64": 1e-13, "float32": 1e-5}
LOG3 = math.log(3.0)


@dataclass(frozen=True)
class Rate:
    slope: float | None
    bend: float | None
    reach: int


def ols_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def rate(ratios: Sequence[float], floor: float, first: int = 0) -> Rate:
    """The per-trial statistics of the module docstring from r_0 .. r_L (layers from `first`
    on: 0 is the pre-set statistic; 1 is the sensitivity check of section 5.1)."""
    at_floor = next((layer for layer, r in enumerate(ratios) if r <= floor), len(ratios))
    # a ratio of 1 or more (the composite norm allows it) has no log(-log r): left out
    usable = [layer for layer in range(first, at_floor) if ratios[layer] < 1.0]
    if not usable:
        return Rate(None, None, at_floor - 1)
    ys = [math.log(-math.log(ratios[layer])) for layer in usable]
    xs = [float(layer) for layer in usable]
    slope = ols_slope(xs, ys) if len(usable) >= 3 else None
    bend = None
    if len(usable) >= 5:
        h = (len(usable) - 1) // 2
        bend = ols_slope(xs[h:], ys[h:]) - ols_slope(xs[: h + 1], ys[: h + 1])
    return Rate(slope, bend, at_floor - 1)


def studies() -> dict[str, int]:
    """Study name -> id, from the round's index (the last run of a name wins)."""
    with (ROUND3 / "studies.csv").open() as f:
        return {row["name"]: int(row["study_id"]) for row in csv.DictReader(f)}


def load(name: str) -> tuple[list[dict[str, Any]], dict[tuple[int, int], list[float]]]:
    """The study's trials (CSV rows) and, per (trial number, step), r_0 .. r_L."""
    sid = studies()[name]
    stem = ROUND3 / f"study-{sid}-{name}"
    with (stem.with_suffix(".trials.csv")).open() as f:
        trials = list(csv.DictReader(f))
    table = pq.read_table(stem.with_suffix(".metrics.parquet")).to_pylist()
    by: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for row in table:
        if row["name"] == "rank_ratio":
            by[(row["number"], row["step"])][row["layer"]] = row["value"]
    ratios = {k: [v[layer] for layer in sorted(v)] for k, v in by.items()}
    return trials, ratios


FIRST = 0  # the first layer of the fit: 0 (pre-set) or 1 (sensitivity check)


def arms(
    name: str, keys: Sequence[str]
) -> dict[tuple[str, ...], dict[int, dict[int, tuple[Rate, list[float]]]]]:
    """arm (the values of `keys`) -> seed -> step -> (rate, ratios)."""
    trials, ratios = load(name)
    out: dict[tuple[str, ...], dict[int, dict[int, tuple[Rate, list[float]]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for t in trials:
        assert t["state"] == "COMPLETE", t
        arm = tuple(t[k] for k in keys)
        dtype = t.get("params.dtype") or "float64"
        steps = sorted(s for (n, s) in ratios if n == int(t["number"]))
        for step in steps:
            r = ratios[(int(t["number"]), step)]
            out[arm][int(t["params.seed"])][step] = (rate(r, FLOOR[dtype], FIRST), r)
    return out


def _fmt(xs: list[float]) -> str:
    if len(xs) >= 2:
        return t_interval(xs).fmt(lambda v: f"{v:+.2f}")
    return f"{xs[0]:+.2f} (1 seed)" if xs else "n/a"


def summary_line(seeds: dict[int, dict[int, tuple[Rate, list[float]]]], step: int) -> str:
    rates = [s[step][0] for s in seeds.values() if step in s]
    slopes = [r.slope for r in rates if r.slope is not None]
    bends = [r.bend for r in rates if r.bend is not None]
    reach = sorted(r.reach for r in rates)
    r_mid = reach[len(reach) // 2]
    return (
        f"{_fmt(slopes)} ({len(slopes)}/{len(rates)}) | {_fmt(bends)} ({len(bends)}) | "
        f"{r_mid} ({reach[0]}-{reach[-1]})"
    )


def last_step(seeds: dict[int, dict[int, tuple[Rate, list[float]]]]) -> int:
    return max(max(s) for s in seeds.values())


def table(name: str, keys: Sequence[str], labels: Sequence[str]) -> int:
    """Print one study's arm table; returns the number of intervals in it."""
    data = arms(name, keys)
    head = " | ".join(labels)
    print(
        f"\n{name}: slope of log(-log r_l) [95 % t] (seeds with a slope / seeds) | bend "
        f"[95 % t] (seeds) | reach: median (range)\n"
    )
    print(f"| {head} | step | slope | bend | reach |")
    print("|" + "---|" * (len(labels) + 4))
    n = 0
    for arm in sorted(data, key=lambda a: tuple(_sort_key(v) for v in a)):
        seeds = data[arm]
        for step in (0, last_step(seeds)):
            line = summary_line(seeds, step)
            n += line.count("[")
            print(f"| {' | '.join(arm)} | {step} | {line.replace(' | ', ' | ')} |")
    return n


def _sort_key(v: str) -> tuple[int, float | str]:
    try:
        return (0, float(v))
    except ValueError:
        return (1, v)


def floor_table() -> None:
    """repro-dong-floor: the smallest stored ratio per precision (zero-step probes)."""
    data = arms("repro-dong-floor", ["params.dtype", "params.model.causal",
                                     "params.model.qk_init_std"])  # fmt: skip
    print(
        "\nrepro-dong-floor (zero-step): smallest ratio over layers and seeds, float32 vs "
        "float64; reach (median, range)\n"
    )
    print("| dtype | causal | QK init | smallest r_l | reach | slope [95 % t] |")
    print("|---|---|---|---|---|---|")
    for arm in sorted(data, key=lambda a: tuple(_sort_key(v) for v in a)):
        seeds = data[arm]
        smallest = min(min(s[0][1]) for s in seeds.values())
        rates = [s[0][0] for s in seeds.values()]
        reach = sorted(r.reach for r in rates)
        slopes = [r.slope for r in rates if r.slope is not None]
        print(
            f"| {' | '.join(arm)} | {smallest:.1e} | {reach[len(reach) // 2]} "
            f"({reach[0]}-{reach[-1]}) | {_fmt(slopes)} ({len(slopes)}/{len(rates)}) |"
        )


def example(name: str, keys: Sequence[str], arm: tuple[str, ...], seed: int = 0) -> None:
    data = arms(name, keys)
    for step, (r, ratios) in sorted(data[arm][seed].items()):
        shown = " ".join(f"{v:.1e}" for v in ratios[:9])
        print(
            f"  {name} {arm} seed {seed} step {step}: r_0..r_8 = {shown}; slope "
            f"{r.slope if r.slope is None else round(r.slope, 2)}, reach {r.reach}"
        )


def main() -> None:
    global FIRST
    if "--from-layer" in sys.argv:
        FIRST = int(sys.argv[sys.argv.index("--from-layer") + 1])
        print(f"(sensitivity check: layers {FIRST} on)")
    floor_table()
    total = table("repro-dong-rate", ["params.model.norm", "params.model.causal",
                  "params.model.qk_init_std", "params.model.n_heads"],
                  ["norm", "causal", "QK init", "heads"])  # fmt: skip
    idx = studies()
    if "repro-dong-rate-skip" in idx:
        total += table("repro-dong-rate-skip", ["params.model.causal", "params.model.qk_init_std"],
                       ["causal", "QK init"])  # fmt: skip
    if "repro-dong-rate-mlp" in idx:
        total += table("repro-dong-rate-mlp", ["params.model.norm", "params.model.mlp_init_std",
                       "params.model.causal", "params.model.qk_init_std"],
                       ["norm", "MLP init", "causal", "QK init"])  # fmt: skip
    print(f"\nintervals in these tables: {total} (95 % each)")
    print("\nexamples (seed 0):")
    keys = ["params.model.norm", "params.model.causal", "params.model.qk_init_std",
            "params.model.n_heads"]  # fmt: skip
    example("repro-dong-rate", keys, ("pre", "false", "0.2", "1"))
    example("repro-dong-rate", keys, ("pre", "true", "0.2", "1"))


def _increments(
    name: str, keys: Sequence[str], arm: tuple[str, ...], step: int
) -> dict[int, dict[int, float]]:
    """layer l -> seed -> y_{l+1} - y_l (l = 1, 2, 3), where both layers are above the floor."""
    per: dict[int, dict[int, float]] = defaultdict(dict)
    floor = FLOOR["float64"]
    for seed, steps in arms(name, keys)[arm].items():
        r = steps[step][1]
        for layer in (1, 2, 3):
            a, b = r[layer], r[layer + 1]
            if floor < b < 1.0 and floor < a < 1.0:
                per[layer][seed] = math.log(-math.log(b)) - math.log(-math.log(a))
    return per


def increments_table() -> None:
    """Per-layer increments y_{l+1} - y_l for l = 1, 2, 3 (the log of the factor by which -log r
    grows in one layer: log 3 = 1.10 at the bound's rate, towards 0 for an exponential fall),
    mean [95 % t] over the seeds where both layers are above the floor; the last minus the
    first, paired by seed; and bidirectional minus causal at 3->4, paired by seed (the two
    share every weight: only the mask differs). A sensitivity check added after seeing the
    results."""
    keys = ["params.model.norm", "params.model.causal", "params.model.qk_init_std",
            "params.model.n_heads"]  # fmt: skip
    n = 0
    print("\nper-layer increments of log(-log r_l) (sensitivity check), Pre-LN, QK init 0.2:")
    for heads in ("1", "2"):
        for step in (0, 100):
            per = {}
            for causal in ("false", "true"):
                p = per[causal] = _increments(
                    "repro-dong-rate", keys, ("pre", causal, "0.2", heads), step
                )
                cells = [
                    f"{layer}->{layer + 1}: {_fmt(list(p[layer].values()))} ({len(p[layer])})"
                    for layer in (1, 2, 3)
                ]
                both = sorted(set(p[1]) & set(p[3]))
                diff = [p[3][s] - p[1][s] for s in both]
                print(
                    f"  causal {causal}, {heads} head(s), step {step}: "
                    + "; ".join(cells)
                    + f"; (3->4) - (1->2): {_fmt(diff)} ({len(diff)})"
                )
                n += 4
            b, c = per["false"][3], per["true"][3]
            common = sorted(set(b) & set(c))
            d = [b[s] - c[s] for s in common]
            print(f"    3->4, bidirectional - causal, paired: {_fmt(d)} ({len(d)})")
            n += 1
    print(f"  ({n} intervals)")


def mlp_contrast() -> None:
    """The MLP-Lipschitz contrast of repro-dong-rate-mlp: init std 1.0 minus 0.02 at the same
    norm, mask, QK init, step and seed (the two share every weight but the MLP's scale), for the
    slope and the reach; a larger MLP slowing collapse shows as a lower slope and a later
    reach. Paired by seed, over the seeds where both have the statistic."""
    keys = ["params.model.norm", "params.model.mlp_init_std", "params.model.causal",
            "params.model.qk_init_std"]  # fmt: skip
    data = arms("repro-dong-rate-mlp", keys)
    n = 0
    print("\nrepro-dong-rate-mlp: MLP init std 1.0 minus 0.02, paired by seed [95 % t]\n")
    print("| norm | causal | QK init | step | d slope (seeds) | d reach (seeds) |")
    print("|---|---|---|---|---|---|")
    for norm in ("none", "pre"):
        for causal in ("false", "true"):
            for qk in ("0.02", "0.2", "1.0"):
                big, small = data[(norm, "1.0", causal, qk)], data[(norm, "0.02", causal, qk)]
                for step in (0, last_step(big)):
                    ds = [big[s][step][0].slope - small[s][step][0].slope  # type: ignore[operator]
                          for s in sorted(big)
                          if big[s][step][0].slope is not None
                          and small[s][step][0].slope is not None]  # fmt: skip
                    dr = [float(big[s][step][0].reach - small[s][step][0].reach)
                          for s in sorted(big)]  # fmt: skip
                    same = all(big[s][step][1] == small[s][step][1] for s in sorted(big))
                    n += (len(ds) >= 2) + (len(dr) >= 2)
                    note = " (identical ratios)" if same else ""
                    print(f"| {norm} | {causal} | {qk} | {step} | {_fmt(ds)} ({len(ds)}) "
                          f"| {_fmt(dr)} ({len(dr)}){note} |")  # fmt: skip
    print(f"\n({n} intervals)")


if __name__ == "__main__":
    if "--increments" in sys.argv:
        increments_table()
    elif "--mlp" in sys.argv:
        mlp_contrast()
    else:
        main()
