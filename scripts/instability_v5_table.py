"""Science v5 (docs/reproductions.md section 9), every number printed from its records.

    python scripts/instability_v5_table.py [--dir docs/results/round5/instability]

Reads the service's exports of the four arms (instability-v5-{none,qk-layernorm,zloss,
sigma-all}: trials CSV and the route's LR-sensitivity answer) and applies 9.1's rules: the
unigram floor `u` of the data (workers/unigram.py, on the definitions' evaluation targets)
and each arm's seed-median `l*` against `u - 0.25`; LR sensitivity per arm with a 95 % t
interval (checked against the route's answer); each intervention minus `none` paired by seed
with the paired t-test, Holm over the three; then the descriptive curves. The per-seed
computations are section 7's (scripts/instability_table.py), which follow METRICS.md 9.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import instability_table as it  # noqa: E402
from dong_rate import holm  # noqa: E402

from workers.config import TrialConfig  # noqa: E402
from workers.unigram import unigram_floor  # noqa: E402

RECORDS = ROOT / "docs" / "results" / "round5" / "instability"
DATA = ROOT.parent / "shared" / "data"
ARMS = ("none", "qk-layernorm", "zloss", "sigma-all")
MARGIN = 0.25  # nats below the floor for an arm to be testable (9.1 rule 1)


def floor_of_definition(path: Path) -> float:
    """The unigram floor of a definition's data and evaluation targets."""
    base = yaml.safe_load(path.read_text())["base"]
    base["task"]["data_dir"] = str(DATA / base["task"]["data_dir"])
    value = unigram_floor(TrialConfig.model_validate(base))
    assert value is not None
    return value


def is_testable(l_stars: Sequence[float], floor: float) -> bool:
    """9.1 rule 1: the seed median of l* below the floor by more than MARGIN."""
    return it.median(list(l_stars)) < floor - MARGIN


def primary_verdict(d: it.Paired) -> str:
    """9.1 rule 3 (qk-layernorm - none): the interval of the paired difference decides."""
    if d.interval.hi < 0:
        return "reproduced"
    if d.interval.lo > 0:
        return "not reproduced"
    return "inconclusive"


def secondary_verdict(d: it.Paired, p_holm: float) -> str:
    """9.1 rule 4: Holm-adjusted p < 0.05 and the sign of the difference."""
    if p_holm < 0.05:
        return "lowers LR sensitivity" if d.interval.centre < 0 else "raises LR sensitivity"
    return "inconclusive"


def curve(stats: Mapping[int, it.SeedStats], grid: Sequence[float]) -> list[float]:
    return [it.median([s.losses[i] for s in stats.values()]) for i in range(len(grid))]


def signal_medians(arm: it.Arm, grid: Sequence[float], signal: str) -> list[float]:
    """Seed median of a signal per lr; a missing or non-finite value counts as +inf."""
    out = []
    for lr in grid:
        vals = [arm[s][lr].signals[signal] for s in arm if lr in arm[s]]
        out.append(it.median([v if it._finite(v) else math.inf for v in vals]))  # type: ignore[misc]
    return out


def report(directory: Path) -> str:
    it.PREFIX = "instability-v5-"
    arms, ids, grid = it.load(directory)
    routes = it.route_answers(directory, ids)
    u = floor_of_definition(ROOT / "study_defs" / "instability_v5_none.yaml")
    stats = {a: it.arm_stats(arms[a], grid) for a in ARMS if a in arms}
    out = [f"studies: {ids}", f"grid: {grid}", f"unigram floor u = {u:.4f} nats", ""]

    out += ["| arm | seeds | median l* (min-max) | testable (< u - 0.25) | "
            "LR sensitivity [95 %] | best lr (seed-median curve) |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    testable = {}
    for a, st in stats.items():
        ls = [s.l_star for s in st.values()]
        med = it.median(ls)
        testable[a] = is_testable(ls, u)
        sens = it.one_sample([s.sensitivity for s in st.values()])
        c = curve(st, grid)
        best = grid[c.index(min(c))]
        out.append(
            f"| {a} | {len(st)} | {med:.3f} ({min(ls):.3f}-{max(ls):.3f}) | "
            f"{'yes' if testable[a] else 'no: at the floor'} | {it.fmt(sens)} | {best:g} |"
        )
        route = routes.get(a)
        if route is not None and route.get("sensitivity") is not None:
            assert abs(route["sensitivity"] - sens.centre) < 1e-9, (a, route["sensitivity"])
    best_arm = min(stats, key=lambda a: it.median([s.l_star for s in stats[a].values()]))
    out += ["", f"floor requirement (9.1 rule 1): best arm {best_arm}, "
            f"{'met' if testable[best_arm] else 'NOT met'}", ""]  # fmt: skip

    out += ["| arm - none (paired by seed) | LR sensitivity difference [95 %] | p | Holm p "
            "| verdict |", "|---|---|---|---|---|"]  # fmt: skip
    others = [a for a in ARMS[1:] if a in stats]
    diffs = {
        a: it.paired(
            {s: x.sensitivity for s, x in stats[a].items()},
            {s: x.sensitivity for s, x in stats["none"].items()},
        )
        for a in others
    }
    adjusted = holm([diffs[a].p for a in others])
    for a, p_holm in zip(others, adjusted, strict=True):
        d = diffs[a]
        if not (testable[a] and testable["none"]):
            verdict = "at the floor: not testable"
        elif a == "qk-layernorm":
            verdict = primary_verdict(d)
        else:
            verdict = secondary_verdict(d, p_holm)
        out.append(f"| {a} | {it.fmt_signed(d.interval)} | {d.p:.2g} | {p_holm:.2g} | {verdict} |")

    out += ["", "Descriptive: seed-median final loss l(lr) (diverged as l_0), diverged seeds",
            "", "| lr | " + " | ".join(stats) + " |", "|---" * (len(stats) + 1) + "|"]  # fmt: skip
    curves = {a: curve(st, grid) for a, st in stats.items()}
    for i, lr in enumerate(grid):
        cells = []
        for a in stats:
            n_div = sum(1 for s in arms[a] if lr in arms[a][s] and arms[a][s][lr].diverged)
            cells.append(f"{curves[a][i]:.3f}" + (f" ({n_div}d)" if n_div else ""))
        out.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    for signal in it.SIGNALS:
        out += ["", f"Descriptive: seed median of {signal} per lr (non-finite as inf)", "",
                "| lr | " + " | ".join(stats) + " |", "|---" * (len(stats) + 1) + "|"]  # fmt: skip
        meds = {a: signal_medians(arms[a], grid, signal) for a in stats}
        for i, lr in enumerate(grid):
            out.append(f"| {lr:g} | " + " | ".join(f"{meds[a][i]:.3g}" for a in stats) + " |")
    out += ["", "Descriptive: excess at the top lr, l_s(10) - l*_s, mean [95 %]", ""]
    for a, st in stats.items():
        out.append(f"- {a}: {it.fmt(it.one_sample([s.top_excess for s in st.values()]))}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=RECORDS)
    args = p.parse_args(argv)
    print(report(args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
