"""Bao et al. in round 3 (docs/reproductions.md sections 5.2 and 5.3), from the service's
exports in docs/results/round3/ (trials CSV per study, downloaded over REST).

    python scripts/bao_round3.py          # every table of sections 5.2 and 5.3, as Markdown

5.2, the non-zero mean where it can act (repro-bao-nonzero-mean and its controls): per arm
the manipulation check, the attention endpoints and the validation loss, each arm against the
no-penalty arm paired by seed. 5.3, trainability (repro-bao-trainability, -controls,
-sigma): collapse counts with Fisher's exact test against no penalty, the lowest entropy
seen, the longest plateau, the loss, and the power of the count comparison.

Endpoints, criteria and margins are those fixed in the study definitions before the runs;
intervals and tests come from scripts/intervals.py (t quantiles for every df, one fixed scale
per quantity, pairing by seed).
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Callable
from itertools import product
from pathlib import Path
from typing import Any

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import (  # noqa: E402
    SCALE_OF,
    fisher_two_sided,
    paired_diffs,
    scaled_interval,
    t_interval,
    tost,
)

ROUND3 = Path(__file__).resolve().parents[1] / "docs" / "results" / "round3"
MARGIN = 0.02  # nats: the equivalence margin of section 5.2, fixed before the run
Arm = dict[int, dict[str, Any]]  # seed -> trial row


def studies() -> dict[str, int]:
    with (ROUND3 / "studies.csv").open() as f:
        return {row["name"]: int(row["study_id"]) for row in csv.DictReader(f)}


def trials(name: str) -> list[dict[str, Any]]:
    sid = studies()[name]
    with (ROUND3 / f"study-{sid}-{name}.trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        assert r["state"] == "COMPLETE", (name, r["number"], r["state"])
    return rows


def num(row: dict[str, Any], key: str) -> float:
    return float(row[key])


def by_seed(rows: list[dict[str, Any]], keep: Callable[[dict[str, Any]], bool]) -> Arm:
    out = {int(r["params.seed"]): r for r in rows if keep(r)}
    assert out, "empty arm"
    return out


def values(arm: Arm, key: str) -> dict[int, float]:
    return {s: num(r, key) for s, r in arm.items()}


def cell(arm: Arm, key: str, f: Callable[[float], str] = lambda v: f"{v:.3g}") -> str:
    return scaled_interval(list(values(arm, key).values()), SCALE_OF[key]).fmt(f)


def paired(a: Arm, b: Arm, key: str, f: Callable[[float], str]) -> str:
    return t_interval(paired_diffs(values(a, key), values(b, key))).fmt(f)


def signed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:+.{digits}f}"


# ---- 5.2 ---------------------------------------------------------------------------------


def nonzero_mean() -> int:
    main = trials("repro-bao-nonzero-mean")
    ctrl = trials("repro-bao-nonzero-mean-controls")
    base = by_seed(ctrl, lambda r: r["params.regularizer.kind"] == "none")
    arms: list[tuple[str, Arm, float | None]] = [("no penalty", base, None)]
    arms.append(
        ("spectral variance", by_seed(ctrl, lambda r: r["params.regularizer.kind"] != "none"), None)
    )
    for t in sorted({float(r["params.regularizer.target_mean"]) for r in main}):
        arm = by_seed(main, lambda r, t=t: float(r["params.regularizer.target_mean"]) == t)
        arms.append((f"LocAteR-style t = {t:g}", arm, t))
    n = 0
    print(
        "\n5.2 manipulation check (final evaluation): eigen-mean [95 % t], eigen-variance "
        "(geometric mean [95 %, log scale]), seeds passing the pre-set criterion\n"
    )
    print("| arm | qk_eig_mean | qk_eig_var | passes |\n|---|---|---|---|")
    for label, arm, t in arms:
        mean, var = values(arm, "qk_eig_mean"), values(arm, "qk_eig_var")
        passes = "-"
        if label != "no penalty":
            ok = [
                (t is None or abs(mean[s] - t) <= (0.1 * t if t > 0 else 0.001))
                and var[s] <= 0.01 * num(base[s], "qk_eig_var")
                for s in sorted(arm)
            ]
            passes = f"{sum(ok)} of {len(ok)}"
        print(
            f"| {label} | {t_interval(list(mean.values())).fmt(lambda v: f'{v:.4f}')} "
            f"| {cell(arm, 'qk_eig_var', lambda v: f'{v:.2g}')} | {passes} |"
        )
        n += 2
    print(
        "\n5.2 endpoints per arm (final evaluation; entropy and top-1 mass: [95 %, logit "
        "scale]; validation loss [95 % t])\n"
    )
    print(
        "| arm | min_norm_entropy | top1_mass | final_val_loss | perplexity |\n"
        "|---|---|---|---|---|"
    )
    for label, arm, _ in arms:
        loss = t_interval(list(values(arm, "final_val_loss").values()))
        print(
            f"| {label} | {cell(arm, 'min_norm_entropy', lambda v: f'{v:.3f}')} "
            f"| {cell(arm, 'top1_mass', lambda v: f'{v:.3f}')} "
            f"| {loss.fmt(lambda v: f'{v:.4f}')} | {math.exp(loss.centre):.2f} |"
        )
        n += 3
    print(
        f"\n5.2 each arm minus no penalty, paired by seed (raw differences [95 % t]); loss "
        f"also as a 90 % interval against the +-{MARGIN} nat margin (TOST)\n"
    )
    print(
        "| arm | d entropy | d top-1 mass | d loss [95 %] | d loss [90 %] | equivalent within "
        "+-0.02 |\n|---|---|---|---|---|---|"
    )
    for label, arm, _ in arms[1:]:
        d = paired_diffs(values(arm, "final_val_loss"), values(base, "final_val_loss"))
        iv90, eq = tost(d, MARGIN)
        print(
            f"| {label} | {paired(arm, base, 'min_norm_entropy', signed(3))} "
            f"| {paired(arm, base, 'top1_mass', signed(3))} "
            f"| {t_interval(d).fmt(signed(4))} | {iv90.fmt(signed(4))} | {'yes' if eq else 'no'} |"
        )
        n += 4
    return n


# ---- 5.3 ---------------------------------------------------------------------------------


def fisher_power(p_ref: float, p_arm: float, n: int = 10, alpha: float = 0.05) -> float:
    """P(Fisher two-sided p < alpha) for k_ref ~ Bin(n, p_ref) against k_arm ~ Bin(n, p_arm)."""
    power = 0.0
    for k1, k2 in product(range(n + 1), repeat=2):
        w = stats.binom.pmf(k1, n, p_ref) * stats.binom.pmf(k2, n, p_arm)
        if w > 0 and fisher_two_sided(k1, n, k2, n) < alpha:
            power += w
    return float(power)


def trainability() -> int:
    main = trials("repro-bao-trainability")
    ctrl = trials("repro-bao-trainability-controls")
    sigma = trials("repro-bao-trainability-sigma")
    none = by_seed(ctrl, lambda r: r["params.regularizer.kind"] == "none")
    arms: list[tuple[str, Arm, float | None]] = [("no penalty", none, None)]
    arms.append(
        ("spectral variance", by_seed(ctrl, lambda r: r["params.regularizer.kind"] != "none"), None)
    )
    for t in sorted({float(r["params.regularizer.target_mean"]) for r in main}):
        arm = by_seed(main, lambda r, t=t: float(r["params.regularizer.target_mean"]) == t)
        arms.append((f"LocAteR-style t = {t:g}", arm, t))
    arms.append(("sigma-reparam (positive control)", by_seed(sigma, lambda r: True), None))

    def collapsed(arm: Arm) -> int:
        return sum(r["entropy_collapse"] == "true" for r in arm.values())

    def ever_below(arm: Arm) -> int:
        return sum(num(r, "min_norm_entropy_ever") < 0.1 for r in arm.values())

    k0, e0, n0 = collapsed(none), ever_below(none), len(none)
    n = 0
    print(
        "\n5.3 counts (collapse: final min_norm_entropy < 0.1; ever: below 0.1 at any "
        "evaluation), Fisher's exact test against no penalty (two-sided)\n"
    )
    print(
        "| arm | collapsed [95 % CP] | Fisher p | ever below 0.1 | Fisher p | lowest entropy "
        "seen: median (range) | rank-mean (target): mean, seeds passing |\n"
        "|---|---|---|---|---|---|---|"
    )
    for label, arm, t in arms:
        k, e = collapsed(arm), ever_below(arm)
        ever = sorted(values(arm, "min_norm_entropy_ever").values())
        med = (ever[len(ever) // 2 - 1] + ever[len(ever) // 2]) / 2
        p1 = "-" if arm is none else f"{fisher_two_sided(k, len(arm), k0, n0):.3g}"
        p2 = "-" if arm is none else f"{fisher_two_sided(e, len(arm), e0, n0):.3g}"
        ranks = values(arm, "qk_eig_mean_rank")
        mr = statistics_mean(ranks.values())
        target = ""
        if t is not None:
            tol = 0.1 * t if t > 0 else 0.01
            passing = sum(abs(v - t) <= tol for v in ranks.values())
            target = f" ({t:g}), {passing} of {len(ranks)}"
        lo, hi = clopper_pearson(k, len(arm))
        print(
            f"| {label} | {k} of {len(arm)} [{lo:.2f}, {hi:.2f}] | {p1} | {e} of {len(arm)} "
            f"| {p2} | {med:.2g} ({ever[0]:.2g}-{ever[-1]:.2g}) | {mr:+.3f}{target} |"
        )
    tests = 2 * (len(arms) - 1)
    print(
        f"\n({tests} Fisher tests in this table; Bonferroni at 0.05 / {tests} = "
        f"{0.05 / tests:.4f}; {len(arms)} Clopper-Pearson intervals)"
    )
    t0 = next(a for _, a, t in arms if t == 0.0)
    t2 = next(a for _, a, t in arms if t == 0.2)
    p_exp = fisher_two_sided(collapsed(t2), len(t2), collapsed(t0), len(t0))
    print(
        f"exploratory, not fixed beforehand: t = 0.2 against t = 0, collapsed "
        f"{collapsed(t2)} vs {collapsed(t0)} of 10, Fisher p = {p_exp:.3g}"
    )
    print(
        "\n5.3 longest plateau (steps) and final validation loss, mean [95 % t]; each arm "
        "minus no penalty, paired by seed [95 % t]; target mass [95 %, logit scale]\n"
    )
    print(
        "| arm | longest plateau | d plateau | final_val_loss | d loss | target_mass |\n"
        "|---|---|---|---|---|---|"
    )
    for label, arm, _ in arms:
        plat = t_interval(list(values(arm, "longest_plateau").values())).fmt(lambda v: f"{v:.0f}")
        loss = t_interval(list(values(arm, "final_val_loss").values())).fmt(lambda v: f"{v:.3f}")
        if arm is none:
            dp = dl = "-"
        else:
            dp = paired(arm, none, "longest_plateau", lambda v: f"{v:+.0f}")
            dl = paired(arm, none, "final_val_loss", signed(3))
            n += 2
        print(
            f"| {label} | {plat} | {dp} | {loss} | {dl} "
            f"| {cell(arm, 'target_mass', lambda v: f'{v:.3f}')} |"
        )
        n += 3
    print("\n5.3 power of Fisher's two-sided test at 0.05, 10 vs 10 seeds (exact enumeration):")
    for p_ref, p_arm in ((1.0, 0.0), (1.0, 0.3), (1.0, 0.5), (0.9, 0.3), (0.9, 0.5), (0.7, 0.2)):
        print(
            f"  collapse rate {p_ref:.1f} without, {p_arm:.1f} with: power "
            f"{fisher_power(p_ref, p_arm):.2f}"
        )
    return n


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a binomial rate from k of n."""
    a = (1.0 - conf) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return lo, hi


def statistics_mean(xs: Any) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs)


def main() -> None:
    idx = studies()
    total = 0
    if "repro-bao-nonzero-mean-controls" in idx:
        total += nonzero_mean()
        print(f"\n(5.2 tables: {total} intervals)")
    if "repro-bao-trainability-sigma" in idx:
        n = trainability()
        print(f"\n(5.3 tables: {n} intervals)")


if __name__ == "__main__":
    main()
