"""Dong et al.'s depth rate inside one model: the growth-ratio test of docs/metrics.md section 8
(METRICS.md section 8), pre-registered in docs/reproductions.md section 6.1 before round 4 ran.

    python scripts/dong_rate.py             # round 4 (fresh seeds): the pre-registered test
    python scripts/dong_rate.py --round3    # the same statistics on round 3's study 2 (seeds
                                            # 0-9; exploratory: read after seeing those data)
    python scripts/dong_rate.py --mlp       # round 3's MLP contrast (slope and reach, Holm)
    python scripts/dong_rate.py --skip      # round 3's skip control as counts (Fisher, Holm)

The records are the service's own exports (docs/results/round<N>/: the trials CSV and the
metric rows as Parquet of each study, downloaded over REST by scripts/repro_via_service.py).

**The statistic.** Per trial and evaluation (step 0: as initialised; the last step: after
training), r_l is the stored `rank_ratio` of layer l (0 = the embedding, mean over the probe
batch) and x_l = -log r_l. The increments d_l = x_{l+1} - x_l of the theorem's cubic recursion
x_{l+1} = 3 x_l + c triple whatever c is, so the growth ratio

    log g_l = log(d_l / d_{l-1})      (uses x_{l-1}, x_l, x_{l+1})

is log 3 (1.10) for a doubly exponential fall at the bound's base, some other positive
constant for a doubly exponential fall at another base, and 0 for an exponential one (x_l
linear in l). It is read only where all three layers are above the floor (r > FLOOR: 1e-13 in
float64, about 500 times its round-off floor of ~2e-16; 1e-5 in float32) and both increments
are positive (else it has no logarithm: that seed has no log g_l at that layer, and is
counted). The curvature ("bend") of log x_l depends on c and tells neither apart: an exactly
cubic recursion with c = 0.5 has a negative bend. It is not computed.

**The pre-registered test** (docs/reproductions.md section 6.1, committed before any round-4
run): at each of the fixed layers l = 1, 2, 3, over the seeds, the mean of log g_l with its 95 %
Student-t interval (scripts/intervals.py). A cell (an arm at one evaluation) is

- *not testable* when a fixed layer has log g_l on fewer than MIN_SEEDS seeds (the floor
  came first, or an increment was not positive);
- *doubly exponential* when at every fixed layer the 95 % interval lies above 0: an
  intersection-union test, whose p is the largest of the layers' two-sided t-test p (every
  layer must reject, so no correction across the three layers is needed);
- *exponential* when at every fixed layer the 90 % interval lies inside (-MARGIN, MARGIN),
  MARGIN = log(3) / 2 (nearer to 0 than to the bound's log 3 on this scale): TOST, again an
  intersection-union test (p: the largest of the layers' TOST p);
- *inconclusive* otherwise. (Doubly exponential takes precedence: a growth ratio above 0 at
  every layer is a fall faster than exponential, whatever its base.)

One cell per claim is primary (its p against 0.05); the claim's other cells are secondary,
their p Holm-adjusted over the claim's secondary cells. Whether a doubly exponential cell's
intervals contain log 3 is reported, not a verdict: the theorem bounds the residual, not this
ratio, so a base other than 3 does not contradict it.

`slope` (the least-squares slope of log x_l on l over the layers before the floor) and
`reach` (the last layer before the floor) are reported beside it, never as a verdict.
"""

from __future__ import annotations

import csv
import math
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import Interval, t_interval  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
FLOOR = {"float64": 1e-13, "float32": 1e-5}
LOG3 = math.log(3.0)
FIXED_LAYERS = (1, 2, 3)
MARGIN = LOG3 / 2
MIN_SEEDS = 10
ALPHA = 0.05


# ---- per trial ----------------------------------------------------------------------------


def floor_layer(ratios: Sequence[float], floor: float) -> int:
    """The first layer at or below the floor (len(ratios) when none is)."""
    return next((layer for layer, r in enumerate(ratios) if r <= floor), len(ratios))


def growth(ratios: Sequence[float], floor: float) -> dict[int, float]:
    """layer l -> log g_l = log(d_l / d_{l-1}), d_l = x_{l+1} - x_l, x_l = -log r_l, for every
    l whose three layers l-1, l, l+1 are above the floor and whose two increments are > 0."""
    end = floor_layer(ratios, floor)
    x = [-math.log(r) for r in ratios[:end]]
    d = [b - a for a, b in zip(x, x[1:], strict=False)]  # d[l] = x[l+1] - x[l]
    return {
        layer: math.log(d[layer] / d[layer - 1])
        for layer in range(1, len(d))
        if d[layer] > 0.0 and d[layer - 1] > 0.0
    }


@dataclass(frozen=True)
class Rate:
    """Reported beside the growth ratios, never a verdict."""

    slope: float | None  # least-squares slope of log(-log r_l) on l, 3 or more layers
    reach: int  # the last layer before the floor


def ols_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def rate(ratios: Sequence[float], floor: float, first: int = 0) -> Rate:
    """Slope of log(-log r_l) over the layers from `first` before the floor whose ratio is
    below 1 (the composite-norm ratio can reach 1.0-1.01, where log(-log r) does not exist)."""
    at_floor = floor_layer(ratios, floor)
    usable = [layer for layer in range(first, at_floor) if ratios[layer] < 1.0]
    ys = [math.log(-math.log(ratios[layer])) for layer in usable]
    slope = ols_slope([float(v) for v in usable], ys) if len(usable) >= 3 else None
    return Rate(slope, at_floor - 1)


# ---- per cell (an arm at one evaluation, over seeds) ----------------------------------------


def _t_cdf(t: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.cdf(t, df))


def p_zero(values: Sequence[float]) -> float:
    """Two-sided one-sample t-test p of mean 0 (p < 0.05 iff the 95 % interval excludes 0)."""
    n = len(values)
    m = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))
    if sd == 0.0:
        return 1.0 if m == 0.0 else 0.0
    return 2.0 * (1.0 - _t_cdf(abs(m) / (sd / math.sqrt(n)), n - 1))


def p_tost(values: Sequence[float], margin: float) -> float:
    """TOST p of |mean| < margin (p < 0.05 iff the 90 % interval lies inside the margin)."""
    n = len(values)
    m = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))
    if sd == 0.0:
        return 0.0 if abs(m) < margin else 1.0
    se = sd / math.sqrt(n)
    return max(1.0 - _t_cdf((m + margin) / se, n - 1), _t_cdf((m - margin) / se, n - 1))


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out = [0.0] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class LayerStat:
    layer: int
    values: tuple[float, ...]  # log g_l of the seeds where it is defined
    interval: Interval | None  # mean [95 % t]
    p_zero: float
    p_tost: float


@dataclass(frozen=True)
class CellTest:
    layers: tuple[LayerStat, ...]
    n_seeds: int

    @property
    def testable(self) -> bool:
        return all(len(s.values) >= MIN_SEEDS for s in self.layers)

    @property
    def p_doubly(self) -> float:
        """Intersection-union p of 'log g_l > 0 at every fixed layer'."""
        if not self.testable or any(
            s.interval is None or s.interval.centre <= 0 for s in self.layers
        ):
            return 1.0
        return max(s.p_zero for s in self.layers)

    @property
    def p_exponential(self) -> float:
        """Intersection-union p of '|log g_l| < MARGIN at every fixed layer' (TOST)."""
        if not self.testable:
            return 1.0
        return max(s.p_tost for s in self.layers)

    @property
    def at_bound_base(self) -> bool:
        """Every fixed layer's 95 % interval contains log 3 (descriptive)."""
        return all(s.interval is not None and not s.interval.excludes(LOG3) for s in self.layers)


def cell_test(
    per_seed: Mapping[int, Mapping[int, float]], layers: Sequence[int] = FIXED_LAYERS
) -> CellTest:
    """seed -> (layer -> log g_l) to the cell's test at the fixed layers."""
    stats_ = []
    for layer in layers:
        vals = tuple(g[layer] for _, g in sorted(per_seed.items()) if layer in g)
        ok = len(vals) >= 2
        stats_.append(
            LayerStat(
                layer,
                vals,
                t_interval(vals) if ok else None,
                p_zero(vals) if ok else 1.0,
                p_tost(vals, MARGIN) if ok else 1.0,
            )
        )
    return CellTest(tuple(stats_), len(per_seed))


def outcome(cell: CellTest, p_doubly: float, p_exponential: float) -> str:
    """The pre-registered reading of one cell, from its (possibly Holm-adjusted) p."""
    if not cell.testable:
        return "not testable (< 10 seeds)"
    if p_doubly < ALPHA:
        return "doubly exponential" + (" (base 3 in every interval)" if cell.at_bound_base else "")
    if p_exponential < ALPHA:
        return "exponential"
    return "inconclusive"


# ---- records ------------------------------------------------------------------------------


def studies(round_dir: Path) -> dict[str, int]:
    """Study name -> id, from the round's index (the last run of a name wins)."""
    with (round_dir / "studies.csv").open() as f:
        return {row["name"]: int(row["study_id"]) for row in csv.DictReader(f)}


def load(
    round_dir: Path, name: str
) -> tuple[list[dict[str, Any]], dict[tuple[int, int], list[float]]]:
    """The study's trials (CSV rows) and, per (trial number, step), r_0 .. r_L."""
    import pyarrow.parquet as pq

    sid = studies(round_dir)[name]
    stem = round_dir / f"study-{sid}-{name}"
    with (stem.with_suffix(".trials.csv")).open() as f:
        trials = list(csv.DictReader(f))
    table = pq.read_table(stem.with_suffix(".metrics.parquet")).to_pylist()
    by: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for row in table:
        if row["name"] == "rank_ratio":
            by[(row["number"], row["step"])][row["layer"]] = row["value"]
    ratios = {k: [v[layer] for layer in sorted(v)] for k, v in by.items()}
    return trials, ratios


Arms = dict[tuple[str, ...], dict[int, dict[int, list[float]]]]


def arms(round_dir: Path, name: str, keys: Sequence[str]) -> Arms:
    """arm (the values of `keys`) -> seed -> step -> r_0 .. r_L (COMPLETE trials only)."""
    trials, ratios = load(round_dir, name)
    out: Arms = defaultdict(lambda: defaultdict(dict))
    for t in trials:
        if t["state"] != "COMPLETE":
            print(f"  note: {name} trial {t['number']} is {t['state']}: left out")
            continue
        for (n, step), r in ratios.items():
            if n == int(t["number"]):
                out[tuple(t[k] for k in keys)][int(t["params.seed"])][step] = r
    return out


def _fmt(iv: Interval | None, n: int) -> str:
    return "n/a" if iv is None else f"{iv.fmt(lambda v: f'{v:+.2f}')} ({n})"


@dataclass(frozen=True)
class Row:
    label: str
    step: int
    cell: CellTest
    slopes: tuple[float, ...]
    reach: tuple[int, ...]


def row(label: str, seeds: Mapping[int, Mapping[int, list[float]]], step: int) -> Row:
    floor = FLOOR["float64"]
    per_seed = {s: growth(steps[step], floor) for s, steps in seeds.items() if step in steps}
    rates = [rate(steps[step], floor) for steps in seeds.values() if step in steps]
    slopes = tuple(r.slope for r in rates if r.slope is not None)
    return Row(label, step, cell_test(per_seed), slopes, tuple(sorted(r.reach for r in rates)))


def print_rows(rows: Sequence[Row], primary: tuple[str, int] | None) -> None:
    """One claim's cells: the primary's p as is, the others' Holm-adjusted among themselves
    (no primary: the p of each cell as is, for an exploratory table)."""
    is_primary = [primary == (r.label, r.step) for r in rows]
    secondary = [i for i, p in enumerate(is_primary) if not p]
    pd = [r.cell.p_doubly for r in rows]
    pe = [r.cell.p_exponential for r in rows]
    if primary is not None:
        for ps in (pd, pe):
            for i, adj in zip(secondary, holm([ps[i] for i in secondary]), strict=True):
                ps[i] = adj
    head = " | ".join(f"log g_{layer} [95 %] (seeds)" for layer in FIXED_LAYERS)
    print(f"| cell | step | {head} | p doubly | p exponential | outcome | slope [95 %] | reach |")
    print("|---|---|" + "---|" * (len(FIXED_LAYERS) + 5))
    for i, r in enumerate(rows):
        tag = "" if primary is None else " (primary)" if is_primary[i] else " (Holm)"
        cells = " | ".join(_fmt(s.interval, len(s.values)) for s in r.cell.layers)
        slope = _fmt(t_interval(r.slopes), len(r.slopes)) if len(r.slopes) >= 2 else "n/a"
        reach = f"{r.reach[len(r.reach) // 2]} ({r.reach[0]}-{r.reach[-1]})"
        print(
            f"| {r.label} | {r.step} | {cells} | {pd[i]:.2g}{tag} | {pe[i]:.2g}{tag} | "
            f"{outcome(r.cell, pd[i], pe[i])} | {slope} | {reach} |"
        )


# ---- round 4: the pre-registered studies ---------------------------------------------------

ROUND4 = RESULTS / "round4"
# The primary cell of each claim, at step 0 (as initialised): docs/reproductions.md 6.1.
PRIMARY = {"bidirectional": "Pre-LN, QK 0.2, bidirectional", "causal": "Pre-LN, QK 0.2, causal"}
CLAIM = {"bidirectional": "doubly exponential (Dong et al.)", "causal": "exponential (mask)"}


def round4_cells() -> dict[str, dict[int, dict[int, list[float]]]]:
    """label -> seed -> step -> r_0 .. r_24, for the two pre-registered studies."""
    cells: dict[str, dict[int, dict[int, list[float]]]] = {}
    for name, net, keys in (
        ("repro-dong-growth", "Pre-LN", ["params.model.causal"]),
        ("repro-dong-growth-theorem", "SAN", ["params.model.causal", "params.model.qk_init_std"]),
    ):
        for arm, seeds in arms(ROUND4, name, keys).items():
            qk = arm[1] if len(arm) > 1 else "0.2"
            mask = "causal" if arm[0] == "true" else "bidirectional"
            cells[f"{net}, QK {qk}, {mask}"] = seeds
    return cells


def round4() -> None:
    idx = studies(ROUND4)
    print("round 4 (seeds 10-29), records:", ", ".join(f"study {v} {k}" for k, v in idx.items()))
    cells = round4_cells()
    for mask in ("bidirectional", "causal"):
        print(f"\nclaim: {CLAIM[mask]}; primary cell: {PRIMARY[mask]}, step 0\n")
        rows = [
            row(label, seeds, step)
            for label, seeds in sorted(
                cells.items(), key=lambda kv: (kv[0] != PRIMARY[mask], kv[0])
            )
            if label.endswith(mask)
            for step in (0, 100)
        ]
        print_rows(rows, (PRIMARY[mask], 0))


# ---- round 3: the same statistics, read after seeing the data (exploratory) ----------------

ROUND3 = RESULTS / "round3"
KEYS3 = ["params.model.norm", "params.model.causal", "params.model.qk_init_std",
         "params.model.n_heads"]  # fmt: skip


def round3() -> None:
    print("round 3, study 2 (seeds 0-9): EXPLORATORY, read after seeing those data\n")
    data = arms(ROUND3, "repro-dong-rate", KEYS3)
    rows = []
    for arm in sorted(data):
        norm, causal, qk, heads = arm
        for step in (0, 100):
            mask = "causal" if causal == "true" else "bidirectional"
            rows.append(row(f"{norm}, {mask}, QK {qk}, {heads} head(s)", data[arm], step))
    print_rows(rows, None)


def mlp_contrast() -> None:
    """The MLP-Lipschitz contrast of round 3's repro-dong-rate-mlp: init std 1.0 minus 0.02 at
    the same norm, mask, QK init, step and seed (the two share every weight but the MLP's
    scale), for the slope and the reach, paired by seed. No primary cell was fixed before that
    run, so (docs/reproductions.md, "Claims tested in several cells") every contrast's
    two-sided p is Holm-adjusted over all of them (both measures, every cell)."""
    keys = ["params.model.norm", "params.model.mlp_init_std", "params.model.causal",
            "params.model.qk_init_std"]  # fmt: skip
    data = arms(ROUND3, "repro-dong-rate-mlp", keys)
    floor = FLOOR["float64"]
    lines: list[tuple[str, list[float], list[float]]] = []
    for norm in ("none", "pre"):
        for causal in ("false", "true"):
            for qk in ("0.02", "0.2", "1.0"):
                big, small = data[(norm, "1.0", causal, qk)], data[(norm, "0.02", causal, qk)]
                for step in (0, 100):
                    rb = {s: rate(big[s][step], floor) for s in big}
                    rs = {s: rate(small[s][step], floor) for s in small}
                    ds = [rb[s].slope - rs[s].slope for s in sorted(rb)  # type: ignore[operator]
                          if rb[s].slope is not None and rs[s].slope is not None]  # fmt: skip
                    dr = [float(rb[s].reach - rs[s].reach) for s in sorted(rb)]
                    lines.append((f"{norm} | {causal} | {qk} | {step}", ds, dr))
    # a contrast that is 0 for every seed (both arms at the floor at the same layer, or
    # bit-identical) cannot vary: no test, left out of the family
    tests = [
        (i, k, v)
        for i, (_, ds, dr) in enumerate(lines)
        for k, v in ((0, ds), (1, dr))
        if len(v) >= 2 and any(x != 0.0 for x in v)
    ]
    adjusted = holm([p_zero(v) for _, _, v in tests])
    adj = {(i, k): a for (i, k, _), a in zip(tests, adjusted, strict=True)}
    print("\nrepro-dong-rate-mlp: MLP init std 1.0 minus 0.02, paired by seed [95 % t] "
          f"(Holm over {len(tests)} contrasts; a constant difference has p 0)\n")  # fmt: skip
    print(
        "| norm | causal | QK init | step | d slope (seeds) | Holm p | d reach (seeds) | Holm p |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, (label, ds, dr) in enumerate(lines):
        cells = []
        for k, v in ((0, ds), (1, dr)):
            cells.append(_fmt(t_interval(v), len(v)) if len(v) >= 2 else "n/a")
            cells.append(f"{adj[(i, k)]:.2g}" if (i, k) in adj else "-")
        print(f"| {label} | {' | '.join(cells)} |")


def skip_counts() -> None:
    """Round 3's skip control as a count test: per mask, QK init and step, the trials whose
    last-layer ratio r_24 is below 0.05, pure attention (study 2, Pre-LN, one head) against
    attention + skip (study 7), Fisher's exact test; no primary cell was fixed, so Holm over
    the 12 cells (docs/reproductions.md, "Claims tested in several cells")."""
    from intervals import fisher_two_sided

    pure = arms(ROUND3, "repro-dong-rate", KEYS3)
    skip = arms(ROUND3, "repro-dong-rate-skip", ["params.model.causal", "params.model.qk_init_std"])
    cells = []
    for causal in ("false", "true"):
        for qk in ("0.02", "0.2", "1.0"):
            for step in (0, 100):
                p, k = pure[("pre", causal, qk, "1")], skip[(causal, qk)]
                n_p = sum(v[step][-1] < 0.05 for v in p.values())
                n_k = sum(v[step][-1] < 0.05 for v in k.values())
                cells.append((causal, qk, step, n_p, len(p), n_k, len(k)))
    ps = [fisher_two_sided(c[3], c[4], c[5], c[6]) for c in cells]
    print("\nr_24 < 0.05: pure attention (study 2) vs attention + skip (study 7), Pre-LN\n")
    print("| causal | QK init | step | pure | skip | Fisher p | Holm p |")
    print("|---|---|---|---|---|---|---|")
    for c, p_, a in zip(cells, ps, holm(ps), strict=True):
        print(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]}/{c[4]} | {c[5]}/{c[6]} | {p_:.2g} | {a:.2g} |")


if __name__ == "__main__":
    if "--round3" in sys.argv:
        round3()
    elif "--mlp" in sys.argv:
        mlp_contrast()
    elif "--skip" in sys.argv:
        skip_counts()
    else:
        round4()
