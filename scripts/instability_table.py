"""The instability-proxy table and the per-claim tests of docs/reproductions.md section 7
(Wortsman et al., ICLR 2024), pre-registered in 7.1 before the run, read from the service's own
exports.

    python scripts/instability_table.py [DIR] [--figure PNG]

DIR (default docs/results/round4/instability; round 4's Dong studies keep docs/results/round4/
itself) holds what scripts/repro_via_service.py kept of each study:
`studies.csv` and `study-<id>-instability-lr-grid-<arm>.trials.csv`. One study is one arm; the
arms are paired by seed against `none`.

Per arm and seed s, with l_s(lr) the final validation loss (a diverged trial, a non-finite or
missing loss counted as its l_0, the step-0 loss `init_val_loss`) and l*_s its minimum over
the grid:

- LR sensitivity S_s (METRICS.md section 9): service/read/lr_sensitivity.py's own function,
  the one the `lr-sensitivity` route uses, not a copy;
- stable LR range width W_s: the number of grid lrs whose loss is finite, not diverged and
  within WIDTH_NATS of l*_s;
- rho_s: Spearman's rank correlation between lr and `max_attn_logit_ever` (and
  `max_abs_output_log_z_ever`) over the grid, ties averaged, a missing or non-finite value
  ranked above every finite one;
- the excess l_s(top lr) - l*_s.

Intervals: 95 % Student-t over seeds (scripts/intervals.py); arms against `none` paired by
seed (raw differences; log ratios for the logit signals); p: the paired two-sided t-test of
scripts/dong_rate.py (`p_zero`), Holm over the six interventions (`holm`, the same module).
The decision rules are 7.1's; `verdict_a_b` applies them.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scipy.stats import rankdata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dong_rate import holm, p_zero  # noqa: E402
from intervals import Interval, paired_diffs, scaled_interval, t_interval  # noqa: E402

from service.read.lr_sensitivity import TrialPoint, seed_sensitivity  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "docs" / "results" / "round4" / "instability"
PREFIX = "instability-lr-grid-"
ARMS = ("none", "qk-layernorm", "qk-sigma", "sigma-all", "locater", "spectral", "zloss")
CONTROL = "none"
WIDTH_NATS = 0.1  # 7.1: within 0.1 nats of the seed's best
TOP_EXCESS = 0.5  # 7.1 (a)(ii): the loss at the top lr degrades by more than 0.5 nats
SIGNALS = ("max_attn_logit_ever", "max_abs_output_log_z_ever")


def _num(v: Any) -> float | None:
    """A CSV cell as a float; '' / None / non-numbers as None (NaN and inf stay floats)."""
    if v is None or v == "":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


@dataclass(frozen=True)
class Point:
    """One trial of one arm: what the tests read."""

    seed: int
    lr: float
    loss: float | None
    diverged: bool
    l0: float | None
    signals: dict[str, float | None]


def point(row: Mapping[str, Any]) -> Point:
    """A trials-CSV row of the service's export as a Point."""
    loss = _num(row.get("final_val_loss"))
    diverged = (
        row.get("state") == "DIVERGED" or row.get("status") == "diverged" or not _finite(loss)
    )
    return Point(
        int(float(row["params.seed"] if row.get("params.seed") not in (None, "") else row["seed"])),
        float(row["params.optim.lr"]),
        loss,
        diverged,
        _num(row.get("init_val_loss")),
        {s: _num(row.get(s)) for s in SIGNALS},
    )


Arm = dict[int, dict[float, Point]]  # seed -> lr -> point


def arm_of(rows: Sequence[Mapping[str, Any]]) -> Arm:
    """The ended trials of one study (COMPLETE, DIVERGED, or PRUNED as diverged), by seed and lr;
    anything else (FAILED, RUNNING) is missing and makes its seed incomplete."""
    out: Arm = {}
    for r in rows:
        if r.get("state") not in ("COMPLETE", "DIVERGED", "PRUNED"):
            continue
        p = point(r)
        if r.get("state") == "PRUNED" and not p.diverged:
            continue  # stopped early with no final loss: missing, as the service reads it
        out.setdefault(p.seed, {})[p.lr] = p
    return out


@dataclass(frozen=True)
class SeedStats:
    seed: int
    l0: float
    l_star: float
    sensitivity: float
    width: int
    losses: list[float]  # l(lr) over the grid, diverged as l0
    rho: dict[str, float]
    top_excess: float
    top_signal: dict[str, float | None]


def spearman(x: Sequence[float], y: Sequence[float | None]) -> float:
    """Spearman's rho of x and y, ties averaged; a missing or non-finite y ranks above every
    finite one (all such tie). 0 when either side is constant (no order to correlate)."""
    big = max([abs(v) for v in y if _finite(v)] + [1.0]) * 10.0 + 1.0
    yy = [v if _finite(v) else big for v in y]  # type: ignore[misc]
    rx, ry = rankdata(x), rankdata(yy)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0.0 or syy == 0.0:
        return 0.0
    return float(sxy / math.sqrt(sxx * syy))


def seed_stats(grid: Sequence[float], pts: Mapping[float, Point]) -> SeedStats | None:
    """One seed's endpoints (7.1), or None when a grid lr or l_0 is missing."""
    if any(lr not in pts for lr in grid):
        return None
    inits = [p.l0 for p in pts.values() if _finite(p.l0)]
    if not inits:
        return None
    l0 = math.fsum(inits) / len(inits)  # type: ignore[arg-type]
    tps = {
        lr: TrialPoint(p.seed, lr, p.loss, p.diverged, p.l0) for lr, p in pts.items() if lr in grid
    }
    res = seed_sensitivity(grid, tps, l0)
    assert res is not None
    width = sum(
        1
        for lr, v in zip(grid, res.losses, strict=True)
        if not pts[lr].diverged and _finite(pts[lr].loss) and v - res.l_star <= WIDTH_NATS
    )
    rho = {
        s: spearman([math.log(lr) for lr in grid], [pts[lr].signals[s] for lr in grid])
        for s in SIGNALS
    }
    top = max(grid)
    return SeedStats(
        next(iter(pts.values())).seed,
        l0,
        res.l_star,
        res.sensitivity,
        width,
        res.losses,
        rho,
        res.losses[-1] - res.l_star if grid[-1] == top else float("nan"),
        {s: pts[top].signals[s] for s in SIGNALS},
    )


def arm_stats(arm: Arm, grid: Sequence[float]) -> dict[int, SeedStats]:
    out = {}
    for seed in sorted(arm):
        st = seed_stats(grid, arm[seed])
        if st is not None:
            out[seed] = st
    return out


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def seed_median_width(stats: Mapping[int, SeedStats], grid: Sequence[float]) -> int:
    """The width read on the arm's seed-median curve (diverged trials at l_0, as the service's
    curve): grid lrs whose median loss is within WIDTH_NATS of the curve's best and below the
    median l_0 (so a median that is a diverged trial's l_0 never counts)."""
    curve = [median([s.losses[i] for s in stats.values()]) for i in range(len(grid))]
    best = min(curve)
    l0 = median([s.l0 for s in stats.values()])
    return sum(1 for v in curve if v - best <= WIDTH_NATS and v < l0)


@dataclass(frozen=True)
class Paired:
    """An arm minus the control, paired by seed: the interval and the t-test p."""

    interval: Interval
    p: float
    n: int


def paired(a: Mapping[int, float], b: Mapping[int, float], scale: str = "raw") -> Paired:
    seeds = sorted(set(a) & set(b))
    d = paired_diffs({s: a[s] for s in seeds}, {s: b[s] for s in seeds}, scale)  # type: ignore[arg-type]
    return Paired(t_interval(d), p_zero(d), len(d))


def one_sample(values: Sequence[float]) -> Interval:
    return t_interval(list(values))


def log_top_signal(stats: Mapping[int, SeedStats], signal: str) -> dict[int, float]:
    """The signal at the top lr per seed, only where finite and positive (log scale)."""
    out = {}
    for s, st in stats.items():
        v = st.top_signal[signal]
        if _finite(v) and v > 0:  # type: ignore[operator]
            out[s] = float(v)  # type: ignore[arg-type]
    return out


@dataclass(frozen=True)
class ClaimTest:
    """The four tests of 7.1 (a) or (b) and the verdict they give."""

    rho: Interval  # (i) in the control
    excess: Interval  # (ii) in the control, at the top lr
    log_ratio: Paired  # (iii) intervention / control at the top lr, log scale
    sensitivity: Paired  # (iv) intervention - control
    verdict: str


def verdict_a_b(rho: Interval, excess: Interval, log_ratio: Paired, sens: Paired) -> str:
    """7.1's rule for (a) and (b)."""
    i = rho.lo > 0.0
    ii = excess.lo > TOP_EXCESS
    iii = log_ratio.interval.hi < 0.0
    iv = sens.interval.hi < 0.0
    if i and ii and iii and iv:
        return "reproduced"
    if log_ratio.interval.lo > 0.0 or sens.interval.lo > 0.0:
        return "not reproduced"
    if not (i and ii):
        return "the instability does not show at this scale"
    return "inconclusive"


def claim_test(
    control: Mapping[int, SeedStats], treated: Mapping[int, SeedStats], signal: str
) -> ClaimTest:
    rho = one_sample([st.rho[signal] for st in control.values()])
    excess = one_sample([st.top_excess for st in control.values()])
    ratio = paired(log_top_signal(treated, signal), log_top_signal(control, signal), "log")
    sens = paired(
        {s: st.sensitivity for s, st in treated.items()},
        {s: st.sensitivity for s, st in control.items()},
    )
    return ClaimTest(rho, excess, ratio, sens, verdict_a_b(rho, excess, ratio, sens))


def table_verdict(diff: Paired, p_holm: float) -> str:
    """7.1 (c): lowers LR sensitivity (reproduced) / raises it (not reproduced) / inconclusive."""
    if p_holm < 0.05:
        return "reproduced" if diff.interval.centre < 0 else "not reproduced"
    return "inconclusive"


def where_it_starts(
    control: Mapping[int, SeedStats],
    treated: Mapping[int, SeedStats],
    arm_c: Arm,
    arm_t: Arm,
    grid: Sequence[float],
    signal: str,
) -> float | None:
    """Descriptive (7.1): the lowest lr where the control's seed-median signal is at least
    twice the intervention's; None if nowhere on the grid."""
    for lr in grid:
        c = [arm_c[s][lr].signals[signal] for s in control]
        t = [arm_t[s][lr].signals[signal] for s in treated]
        cf = [v if _finite(v) else math.inf for v in c]
        tf = [v if _finite(v) else math.inf for v in t]
        if median(cf) >= 2.0 * median(tf):  # type: ignore[arg-type]
            return lr
    return None


# --- reading the records ---------------------------------------------------------------------


def load(directory: Path) -> tuple[dict[str, Arm], dict[str, int], list[float]]:
    """Arms by name, their study ids, and the grid (every lr any arm holds, sorted)."""
    arms: dict[str, Arm] = {}
    ids: dict[str, int] = {}
    with (directory / "studies.csv").open() as f:
        studies = list(csv.DictReader(f))
    for st in studies:
        name = st["name"]
        if not name.startswith(PREFIX):
            continue
        arm = name.removeprefix(PREFIX)
        path = directory / f"study-{st['study_id']}-{name}.trials.csv"
        with path.open() as f:
            arms[arm] = arm_of(list(csv.DictReader(f)))
        ids[arm] = int(st["study_id"])
    grid = sorted({lr for a in arms.values() for pts in a.values() for lr in pts})
    return arms, ids, grid


def route_answers(directory: Path, ids: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """The service's own `GET /v1/studies/{id}/lr-sensitivity` answer per arm, where
    scripts/repro_via_service.py --lr-sensitivity kept it (its one group: no group_by)."""
    import json

    out = {}
    for arm, sid in ids.items():
        path = directory / f"study-{sid}-{PREFIX}{arm}.lr_sensitivity.json"
        if path.exists():
            out[arm] = json.loads(path.read_text())["groups"][0]
    return out


def fmt(iv: Interval, digits: int = 3) -> str:
    return f"{iv.centre:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


def fmt_signed(iv: Interval, digits: int = 3) -> str:
    return f"{iv.centre:+.{digits}f} [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}]"


def fmt_ratio(iv: Interval) -> str:
    e = math.exp
    return f"x{e(iv.centre):.3g} [x{e(iv.lo):.3g}, x{e(iv.hi):.3g}]"


def report(directory: Path, figure: Path | None = None) -> str:
    arms, ids, grid = load(directory)
    stats = {a: arm_stats(arm, grid) for a, arm in arms.items()}
    out: list[str] = []
    w = out.append
    w(f"grid ({len(grid)} lrs): {', '.join(f'{lr:g}' for lr in grid)}")
    w(
        "\n| arm | study | seeds | LR sensitivity (nats) | vs none, paired | Holm p | "
        "stable width (of 7) | vs none | Holm p | median-curve width |"
    )
    w("|---|---|---|---|---|---|---|---|---|---|")
    control = stats[CONTROL]
    others = [a for a in ARMS if a in stats and a != CONTROL]
    sens_d = {
        a: paired(
            {s: st.sensitivity for s, st in stats[a].items()},
            {s: st.sensitivity for s, st in control.items()},
        )
        for a in others
    }
    width_d = {
        a: paired(
            {s: float(st.width) for s, st in stats[a].items()},
            {s: float(st.width) for s, st in control.items()},
        )
        for a in others
    }
    hs = dict(zip(others, holm([sens_d[a].p for a in others]), strict=True))
    hw = dict(zip(others, holm([width_d[a].p for a in others]), strict=True))
    for a in [CONTROL, *others]:
        st = stats[a]
        s_iv = one_sample([x.sensitivity for x in st.values()])
        w_iv = one_sample([float(x.width) for x in st.values()])
        cmp_s = fmt_signed(sens_d[a].interval) if a in sens_d else "-"
        cmp_w = fmt_signed(width_d[a].interval, 2) if a in width_d else "-"
        ps = f"{hs[a]:.3g}" if a in hs else "-"
        pw = f"{hw[a]:.3g}" if a in hw else "-"
        w(
            f"| {a} | {ids[a]} | {len(st)} | {fmt(s_iv)} | {cmp_s} | {ps} | {fmt(w_iv, 2)} | "
            f"{cmp_w} | {pw} | {seed_median_width(st, grid)} |"
        )
    routes = route_answers(directory, ids)
    for a, g in routes.items():
        mine = one_sample([x.sensitivity for x in stats[a].values()])
        same = all(
            math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
            for x, y in (
                (g["sensitivity"], mine.centre),
                (g["ci_low"], mine.lo),
                (g["ci_high"], mine.hi),
            )
        )
        w(
            f"service route, {a}: {g['sensitivity']:.3f} [{g['ci_low']:.3f}, {g['ci_high']:.3f}], "
            f"{g['n_seeds']} seeds: {'the same' if same else 'DIFFERENT'}"
        )
    w("\n(c) LR sensitivity against none, Holm over the six interventions:")
    for a in others:
        v = table_verdict(sens_d[a], hs[a])
        w(f"  {a}: {v} (paired t p {sens_d[a].p:.3g}, Holm {hs[a]:.3g})")
    w("\nLogit signals per arm: mean Spearman rho(lr, signal) over seeds [95 % t], and the value")
    w("at the top lr (geometric mean [95 % t] over seeds); exploratory beyond (a) and (b):")
    w("| arm | rho max_attn_logit_ever | at top lr | rho max_abs_output_log_z_ever | at top lr |")
    w("|---|---|---|---|---|")
    for a in [CONTROL, *others]:
        cells = []
        for sname in SIGNALS:
            rho = one_sample([x.rho[sname] for x in stats[a].values()])
            top_v = list(log_top_signal(stats[a], sname).values())
            g = scaled_interval(top_v, "log") if len(top_v) >= 2 else None
            cells += [fmt_signed(rho, 2), g.fmt(lambda v: f"{v:.3g}") if g else "-"]
        w(f"| {a} | " + " | ".join(cells) + " |")
    w(
        "\nCurves: seed medians per lr (loss with diverged as l_0 | max_attn_logit_ever | "
        "max_abs_output_log_z_ever | diverged trials)"
    )
    for a in [CONTROL, *others]:
        w(f"  {a}:")
        for i, lr in enumerate(grid):
            loss = median([st.losses[i] for st in stats[a].values()])
            sig = []
            for sname in SIGNALS:
                vals = [arms[a][s][lr].signals[sname] for s in stats[a]]
                sig.append(median([v if _finite(v) else math.inf for v in vals]))  # type: ignore
            div = sum(arms[a][s][lr].diverged for s in stats[a])
            w(
                f"    lr {lr:<10g} loss {loss:7.3f}  logit {sig[0]:9.3g}  "
                f"|logZ| {sig[1]:9.3g}  diverged {div}"
            )
    for label, arm, signal in (
        ("(a) attention logit growth, qk-layernorm", "qk-layernorm", SIGNALS[0]),
        ("(b) output logit divergence, z-loss", "zloss", SIGNALS[1]),
    ):
        if arm not in stats:
            continue
        ct = claim_test(control, stats[arm], signal)
        w(f"\n{label} ({signal}):")
        w(f"  (i) none: mean Spearman rho(lr, {signal}) {fmt_signed(ct.rho)}")
        w(f"      {arm}: {fmt_signed(one_sample([st.rho[signal] for st in stats[arm].values()]))}")
        top = grid[-1]
        w(f"  (ii) none: excess l(lr {top:g}) - l* {fmt_signed(ct.excess)} nats")
        w(f"       (needs its interval above {TOP_EXCESS})")
        r = ct.log_ratio
        w(f"  (iii) {arm} / none at lr {top:g}: {fmt_ratio(r.interval)} (p {r.p:.3g}, {r.n} seeds)")
        d = sens_d[arm]
        w(f"  (iv) LR sensitivity {arm} - none: {fmt_signed(d.interval)} (p {d.p:.3g})")
        start = where_it_starts(control, stats[arm], arms[CONTROL], arms[arm], grid, signal)
        where = f"from lr {start:g}" if start is not None else "nowhere on the grid"
        w(f"  descriptive: none's seed-median {signal} >= 2x {arm}'s: {where}")
        w(f"  verdict: {ct.verdict}")
    if figure is not None:
        plot(figure, arms, stats, grid)
        w(f"\nfigure: {figure}")
    return "\n".join(out)


def plot(
    path: Path,
    arms: Mapping[str, Arm],
    stats: Mapping[str, Mapping[int, SeedStats]],
    grid: Sequence[float],
) -> None:
    """Final loss, max_attn_logit_ever and max_abs_output_log_z_ever against lr (seed medians),
    one line per arm, l_0 dashed: Wortsman et al.'s Figure 1 layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for a in ARMS:
        if a not in stats:
            continue
        st = stats[a]
        loss = [median([x.losses[i] for x in st.values()]) for i in range(len(grid))]
        axes[0].plot(grid, loss, marker="o", label=a)
        for ax, sname in zip(axes[1:], SIGNALS, strict=True):
            vals = [
                median(
                    [
                        v if _finite(v) else math.nan
                        for v in [arms[a][s][lr].signals[sname] for s in st]
                    ]
                )  # type: ignore[misc]
                for lr in grid
            ]
            ax.plot(grid, vals, marker="o", label=a)
    l0 = median([x.l0 for x in stats[CONTROL].values()])
    axes[0].axhline(l0, linestyle="--", color="grey", label="l_0")
    titles = (
        "final validation loss (diverged = l_0)",
        "max_attn_logit_ever",
        "max_abs_output_log_z_ever",
    )
    for ax, t in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(t)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "Instability proxies, 2-layer Llama-style block, WikiText-2 (seed medians, 5 seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    p.add_argument("--figure", type=Path, default=None)
    args = p.parse_args(argv)
    print(report(args.directory, args.figure))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
