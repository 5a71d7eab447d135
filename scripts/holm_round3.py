"""Holm's correction for the round-3 Bao rows tested in several cells (docs/reproductions.md,
"Claims tested in several cells"): no primary cell was fixed before studies 4-5 ran, so each
claim's verdict is read from all its cells with Holm-adjusted p.

    python scripts/holm_round3.py

- entropy collapse (studies 4-5): collapsed trials per arm against no penalty, Fisher's exact
  test (scripts/bao_round3.py prints the counts), Holm over the five penalised arms;
- the longest plateau (studies 4-5): each arm minus no penalty, paired by seed, two-sided t-test,
  Holm over the same five arms;
- the non-zero mean where it can act (studies 8-9, 5 seeds): attention entropy
  (`min_norm_entropy`) and validation loss, each arm minus no penalty, paired by seed, t-test,
  Holm over the five penalised arms per measure.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bao_round3 as bao  # noqa: E402
from dong_rate import holm, p_zero  # noqa: E402
from intervals import fisher_two_sided, paired_diffs, t_interval  # noqa: E402


def _arms(name: str) -> tuple[bao.Arm, list[tuple[str, bao.Arm]]]:
    """No penalty, and the penalised arms (variance only, then each LocAteR-style target) of
    study `name` and its `-controls` study, each by seed."""
    main_ = bao.trials(name)
    ctrl = bao.trials(f"{name}-controls")
    none = bao.by_seed(ctrl, lambda r: r["params.regularizer.kind"] == "none")
    arms = [("variance only", bao.by_seed(ctrl, lambda r: r["params.regularizer.kind"] != "none"))]
    for t in sorted({float(r["params.regularizer.target_mean"]) for r in main_}):
        keep = lambda r, t=t: float(r["params.regularizer.target_mean"]) == t  # noqa: E731
        arms.append((f"LocAteR-style t = {t:g}", bao.by_seed(main_, keep)))
    return none, arms


def main() -> None:
    none, arms = _arms("repro-bao-trainability")

    def collapsed(arm: bao.Arm) -> int:
        return sum(r["entropy_collapse"] == "true" for r in arm.values())

    k0 = collapsed(none)
    fisher = [fisher_two_sided(collapsed(a), len(a), k0, len(none)) for _, a in arms]
    print(f"entropy collapse, against no penalty ({k0} of {len(none)}); Holm over {len(arms)}\n")
    print("| arm | collapsed | Fisher p | Holm p |")
    print("|---|---|---|---|")
    for (name, a), p, h in zip(arms, fisher, holm(fisher), strict=True):
        print(f"| {name} | {collapsed(a)} of {len(a)} | {p:.2g} | {h:.2g} |")

    diffs = [paired_diffs(bao.values(a, "longest_plateau"), bao.values(none, "longest_plateau"))
             for _, a in arms]  # fmt: skip
    ps = [p_zero(d) for d in diffs]
    print(f"\nlongest plateau (steps), minus no penalty, paired by seed; Holm over {len(arms)}\n")
    print("| arm | difference [95 % t] | p | Holm p |")
    print("|---|---|---|---|")
    for (name, _), d, p, h in zip(arms, diffs, ps, holm(ps), strict=True):
        print(f"| {name} | {t_interval(d).fmt(lambda v: f'{v:+.0f}')} | {p:.2g} | {h:.2g} |")

    nonzero_mean()


def nonzero_mean() -> None:
    none, arms = _arms("repro-bao-nonzero-mean")
    for key, digits in (("min_norm_entropy", 3), ("final_val_loss", 4)):
        diffs = [paired_diffs(bao.values(a, key), bao.values(none, key)) for _, a in arms]
        ps = [p_zero(d) for d in diffs]
        print(f"\nstudies 8-9, {key}, minus no penalty, paired by seed; Holm over {len(arms)}\n")
        print("| arm | difference [95 % t] | p | Holm p |")
        print("|---|---|---|---|")
        for (name, _), d, p, h in zip(arms, diffs, ps, holm(ps), strict=True):
            iv = t_interval(d).fmt(lambda v, k=digits: f"{v:+.{k}f}")
            print(f"| {name} | {iv} | {p:.2g} | {h:.2g} |")
        # The contrast that tests the mechanism (t > 0 against t = 0): exploratory, since
        # round 3 fixed no such contrast before the run (docs/reproductions.md, 5.2).
        zero = dict(arms)["LocAteR-style t = 0"]
        pos = [
            (n, a) for n, a in arms if n.startswith("LocAteR-style") and n != "LocAteR-style t = 0"
        ]
        diffs = [paired_diffs(bao.values(a, key), bao.values(zero, key)) for _, a in pos]
        ps = [p_zero(d) for d in diffs]
        print(
            f"\nstudies 8-9, {key}, t > 0 minus t = 0, paired by seed (exploratory);"
            f" Holm over {len(pos)}\n"
        )
        print("| arm | difference [95 % t] | p | Holm p |")
        print("|---|---|---|---|")
        for (name, _), d, p, h in zip(pos, diffs, ps, holm(ps), strict=True):
            iv = t_interval(d).fmt(lambda v, k=digits: f"{v:+.{k}f}")
            print(f"| {name} | {iv} | {p:.2g} | {h:.2g} |")


if __name__ == "__main__":
    main()
