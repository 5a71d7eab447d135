"""The exploratory addendum of docs/reproductions.md 7.8 (above lr 1), read from its records.

    python scripts/instability_high_lr.py

For each study in docs/results/round4/instability/high_lr/ (and, beside them, the same three
arms of 7.1's grid, studies 1-3 of docs/results/round4/instability/), per learning rate: how
many of the seeds diverged (DIVERGED or a non-finite loss) or ended above their own l_0 (the
untrained model's validation loss, `init_val_loss`), the median final loss, and the medians
of `max_attn_logit_ever` and `max_abs_output_log_z_ever`.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs" / "results" / "round4" / "instability"


def _f(x: str | None) -> float:
    try:
        return float(x) if x is not None else math.nan
    except ValueError:
        return math.nan


def gave_way(row: dict[str, str]) -> bool:
    """Diverged, or no better than the untrained model at the end."""
    final = _f(row["final_val_loss"])
    return (
        row["state"] == "DIVERGED" or not math.isfinite(final) or final > _f(row["init_val_loss"])
    )


def _median(rows: list[dict[str, str]], key: str) -> float:
    values = [v for r in rows if math.isfinite(v := _f(r[key]))]
    return statistics.median(values) if values else math.nan


def table(path: Path) -> list[str]:
    by_lr: dict[float, list[dict[str, str]]] = {}
    for row in csv.DictReader(path.open()):
        by_lr.setdefault(_f(row["params.optim.lr"]), []).append(row)
    out = [
        f"{path.name}",
        "| lr | gave way (diverged or above l_0) | median final loss | median max_attn_logit_ever"
        " | median max_abs_output_log_z_ever |",
        "|---|---|---|---|---|",
    ]
    for lr, rows in sorted(by_lr.items()):
        out.append(
            f"| {lr:g} | {sum(map(gave_way, rows))} of {len(rows)} | "
            f"{_median(rows, 'final_val_loss'):.3f} | {_median(rows, 'max_attn_logit_ever'):.3g}"
            f" | {_median(rows, 'max_abs_output_log_z_ever'):.3g} |"
        )
    return out


def main() -> None:
    paths = sorted((ROOT / "high_lr").glob("study-*.trials.csv"))
    paths += [next(ROOT.glob(f"study-{i}-*.trials.csv")) for i in (1, 2, 3)]
    for path in paths:
        print("\n".join(table(path)), end="\n\n")


if __name__ == "__main__":
    main()
