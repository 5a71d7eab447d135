"""The loss-curve metrics of docs/metrics.md section 5 (plateaus, trapped); torch-free.

They work on plain lists of evaluation steps and losses, so the study runner and the
pruning trackers use them without loading torch. `workers.metrics` re-exports them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["detect_plateaus", "ema", "is_trapped", "plateau_stats"]


def detect_plateaus(
    steps: Sequence[int], losses: Sequence[float], window: int, rel_tol: float
) -> list[tuple[int, int]]:
    """Merged (start_step, end_step) intervals where the loss stopped falling. [5]

    Point k >= window is flat when losses[k - window] - losses[k] <
    rel_tol * |losses[k - window]|; a maximal run of flat points k_a..k_b
    spans (steps[k_a - window], steps[k_b]); overlapping or touching spans merge.
    """
    if len(steps) != len(losses):
        raise ValueError(f"steps ({len(steps)}) and losses ({len(losses)}) differ in length")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = len(losses)
    flat = [
        k >= window and losses[k - window] - losses[k] < rel_tol * abs(losses[k - window])
        for k in range(n)
    ]
    runs: list[tuple[int, int]] = []
    k = window
    while k < n:
        if not flat[k]:
            k += 1
            continue
        start = k
        while k + 1 < n and flat[k + 1]:
            k += 1
        runs.append((steps[start - window], steps[k]))
        k += 1
    merged: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def ema(values: Sequence[float], alpha: float) -> list[float]:
    """Exponential moving average: s_0 = v_0, s_k = alpha * v_k + (1 - alpha) * s_{k-1}."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def plateau_stats(intervals: Sequence[tuple[int, int]], last_step: int) -> dict[str, int]:
    """plateau_count / plateau_steps over escaped plateaus, and longest_plateau. [5]

    An interval is escaped when it ends before the last evaluation; the
    longest plateau counts every interval, escaped or not.
    """
    escaped = [(a, b) for a, b in intervals if b < last_step]
    return {
        "plateau_count": len(escaped),
        "plateau_steps": sum(b - a for a, b in escaped),
        "longest_plateau": max((b - a for a, b in intervals), default=0),
    }


def is_trapped(
    intervals: Sequence[tuple[int, int]],
    last_step: int,
    final_loss: float,
    reference_loss: float | None,
    rel_gap: float,
) -> bool:
    """Still on a plateau at the end, and more than `rel_gap` above the reference loss. [5]

    The reference is the best loss of the study's completed trials or the
    task's known optimum. "rel_gap above" is taken relative to
    max(|reference|, 1 nat), so a known optimum of 0 still gives a usable gap.
    """
    if not intervals or intervals[-1][1] != last_step or reference_loss is None:
        return False
    if not math.isfinite(final_loss):
        return True
    return final_loss - reference_loss > rel_gap * max(abs(reference_loss), 1.0)
