"""Bao et al. in the paper's own setting, round 4 (docs/reproductions.md section 5.5), from
the service's exports in docs/results/round4/bao/ (trials CSV per study, downloaded over REST).

    python scripts/bao_round4.py          # every table of section 5.5, as Markdown
    python scripts/bao_round4.py --dir docs/results/round5/bao_fairseq   # section 5.6

With `--dir`, the same tables and rules from another run's exports (5.6: the same studies
with fairseq's q, k, v init, named repro-bao-fairseq-*).

The decision rules are the ones pre-registered in section 5.5 before the run: non-zero mean
(N1: t > 0 against t = 0 and against variance only, Holm over four; N2: primary cell t = 0.01
against no penalty, secondary Holm over three), on best_val_loss paired by seed, with the
+-0.02-nat TOST margin; trainability (T1: primary cell t = 0.02 against no penalty, Fisher;
secondary Holm over three), on final min_norm_entropy < 0.1.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import SCALE_OF, fisher_two_sided, paired_diffs, scaled_interval, t_interval, tost  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "round4" / "bao"
PREFIX = "own"  # the studies' names: repro-bao-own-* (5.5) or repro-bao-fairseq-* (5.6)
MARGIN = 0.02  # nats, fixed before the run
COLLAPSE = 0.1  # final min_norm_entropy below it: entropy collapse
Arm = dict[int, dict[str, Any]]  # seed -> trial row


def studies() -> dict[str, int]:
    with (OUT / "studies.csv").open() as f:
        return {row["name"]: int(row["study_id"]) for row in csv.DictReader(f)}


def trials(name: str) -> list[dict[str, Any]]:
    sid = studies()[name]
    with (OUT / f"study-{sid}-{name}.trials.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        assert r["state"] == "COMPLETE", (name, r["number"], r["state"])
    return rows


def by_seed(rows: list[dict[str, Any]], keep: Callable[[dict[str, Any]], bool]) -> Arm:
    out = {int(r["params.seed"]): r for r in rows if keep(r)}
    assert out, "empty arm"
    return out


def values(arm: Arm, key: str) -> dict[int, float]:
    return {s: float(r[key]) for s, r in arm.items()}


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adj = [0.0] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adj[i] = running
    return adj


def arms_of(study: str) -> dict[str, Arm]:
    main, ctrl = trials(study), trials(f"{study}-controls")
    arms = {
        "no penalty": by_seed(ctrl, lambda r: r["params.regularizer.kind"] == "none"),
        "variance only": by_seed(ctrl, lambda r: r["params.regularizer.kind"] != "none"),
    }
    for t in sorted({float(r["params.regularizer.target_mean"]) for r in main}):
        arms[f"t = {t:g}"] = by_seed(
            main, lambda r, t=t: float(r["params.regularizer.target_mean"]) == t
        )
    return arms


def target_of(label: str) -> float | None:
    return float(label.split("= ")[1]) if label.startswith("t = ") else None


def mean_iv(arm: Arm, key: str, digits: int) -> str:
    """The arm's t interval of `key`, raw scale."""
    return t_interval(list(values(arm, key).values())).fmt(lambda v: f"{v:.{digits}f}")


def scaled_iv(arm: Arm, key: str, f: Callable[[float], str]) -> str:
    """The arm's interval of `key` on its fixed scale (scripts/intervals.py SCALE_OF)."""
    return scaled_interval(list(values(arm, key).values()), SCALE_OF[key]).fmt(f)


def manipulation(arms: dict[str, Arm]) -> None:
    base = arms["no penalty"]
    print("| arm | qk_eig_mean [95 %] | qk_eig_var (geo. mean [95 %]) | passes |")
    print("|---|---|---|---|")
    for label, arm in arms.items():
        mean, var = values(arm, "qk_eig_mean"), values(arm, "qk_eig_var")
        t = target_of(label)
        passes = "-"
        if label != "no penalty":
            ok = [
                (t is None or abs(mean[s] - t) <= (0.1 * t if t > 0 else 0.001))
                and var[s] <= 0.01 * float(base[s]["qk_eig_var"])
                for s in sorted(arm)
            ]
            passes = f"{sum(ok)} of {len(ok)}"
        var_iv = scaled_iv(arm, "qk_eig_var", lambda v: f"{v:.2g}")
        print(f"| {label} | {mean_iv(arm, 'qk_eig_mean', 4)} | {var_iv} | {passes} |")


def contrast(a: Arm, b: Arm, key: str) -> tuple[str, str, float, bool]:
    d = paired_diffs(values(a, key), values(b, key))
    iv = t_interval(d)
    iv90, equiv = tost(d, MARGIN)
    p = float(stats.ttest_1samp(d, 0.0).pvalue)
    return iv.fmt(lambda v: f"{v:+.4f}"), iv90.fmt(lambda v: f"{v:+.4f}"), p, equiv


def nonzero_mean() -> None:
    arms = arms_of(f"repro-bao-{PREFIX}-nonzero-mean")
    print("\n5.5 non-zero mean: manipulation check (final evaluation)\n")
    manipulation(arms)
    print("\n5.5 non-zero mean: endpoints per arm ([95 %]; entropy, top-1 mass: logit scale)\n")
    print("| arm | best_val_loss | final_val_loss | min_norm_entropy | top1_mass |")
    print("|---|---|---|---|---|")
    three = lambda v: f"{v:.3f}"  # noqa: E731
    for label, arm in arms.items():
        losses = f"{mean_iv(arm, 'best_val_loss', 4)} | {mean_iv(arm, 'final_val_loss', 4)}"
        attn = f"{scaled_iv(arm, 'min_norm_entropy', three)} | {scaled_iv(arm, 'top1_mass', three)}"
        print(f"| {label} | {losses} | {attn} |")
    for title, pairs in (
        (
            "N1, the non-zero mean (Holm over four)",
            [
                ("t = 0.01", "t = 0"),
                ("t = 0.02", "t = 0"),
                ("t = 0.01", "variance only"),
                ("t = 0.02", "variance only"),
            ],
        ),
        ("N2 primary cell", [("t = 0.01", "no penalty")]),
        (
            "N2 secondary (Holm over three)",
            [("t = 0", "no penalty"), ("t = 0.02", "no penalty"), ("variance only", "no penalty")],
        ),
    ):
        rows = [(a, b, *contrast(arms[a], arms[b], "best_val_loss")) for a, b in pairs]
        adj = holm([r[4] for r in rows])
        print(f"\n5.5 {title}: best_val_loss, paired by seed\n")
        print("| contrast | d [95 %] | d [90 %] | p | Holm p | within +-0.02 (TOST) |")
        print("|---|---|---|---|---|---|")
        for (a, b, iv, iv90, p, eq), pa in zip(rows, adj, strict=True):
            print(f"| {a} - {b} | {iv} | {iv90} | {p:.2g} | {pa:.2g} | {'yes' if eq else 'no'} |")


def trainability() -> None:
    arms = arms_of(f"repro-bao-{PREFIX}-trainability")
    print("\n5.5 trainability: manipulation check (final evaluation)\n")
    manipulation(arms)
    count: dict[str, tuple[int, int]] = {}
    print("\n5.5 trainability: collapse counts (final min_norm_entropy < 0.1)\n")
    print("| arm | collapsed | ever below 0.1 | lowest entropy seen: median | final_val_loss |")
    print("|---|---|---|---|---|")
    for label, arm in arms.items():
        fin, ever = values(arm, "min_norm_entropy"), values(arm, "min_norm_entropy_ever")
        k = sum(v < COLLAPSE for v in fin.values())
        count[label] = (k, len(fin))
        e = sum(v < COLLAPSE for v in ever.values())
        med = sorted(ever.values())[len(ever) // 2]
        loss = t_interval(list(values(arm, "final_val_loss").values())).fmt(lambda v: f"{v:.3f}")
        print(f"| {label} | {k} of {len(fin)} | {e} of {len(ever)} | {med:.2g} | {loss} |")
    k0, n0 = count["no penalty"]
    kp, np_ = count["t = 0.02"]
    p1 = fisher_two_sided(kp, np_, k0, n0)
    print(f"\nT1 primary: t = 0.02 {kp} of {np_} vs no penalty {k0} of {n0}: Fisher p = {p1:.2g}")
    sec = [("variance only", "no penalty"), ("t = 0", "no penalty"), ("t = 0.02", "t = 0")]
    ps = [fisher_two_sided(*count[a], *count[b]) for a, b in sec]
    for (a, b), p, pa in zip(sec, ps, holm(ps), strict=True):
        ka, kb = count[a], count[b]
        print(f"T1 secondary: {a} {ka[0]} of {ka[1]} vs {b} {kb[0]} of {kb[1]}: ", end="")
        print(f"p = {p:.2g}, Holm {pa:.2g}")


def main() -> None:
    global OUT, PREFIX
    if len(sys.argv) == 3 and sys.argv[1] == "--dir":
        OUT = Path(sys.argv[2]).resolve()
        PREFIX = "fairseq"
    print("studies:", studies())
    nonzero_mean()
    trainability()


if __name__ == "__main__":
    main()
