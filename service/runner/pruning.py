"""Intermediate values for Optuna's pruners, derived from the metric registry.

The intermediate value of a summary metric after the evaluation at step k is the value the
trial's summary would have if training had stopped right there: the same source series,
reduced within the evaluation and over the evaluations up to k the way the registry says
(`workers.metric_names`), so a pruner compares trials by exactly the number the study
optimises. Every summary the registry marks `intermediate` has one, the plateau counts
included (they need the whole validation-loss curve so far, which the tracker keeps).

A tracker is rebuilt from the stored metric rows when a runner meets a trial already
under way (a resumed trial reports only the evaluations after its checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from service.spec import apply_params
from service.store.models import NO_INDEX
from workers import curves as M
from workers.metric_names import SUMMARY_BY_NAME, Summary, Within

if TYPE_CHECKING:
    from workers.trial import TrialConfig

__all__ = ["IntermediateTracker", "Point", "load_tracker", "reduce_within"]

# (name, layer, head, value): one reported number, layer/head None where it has none.
Point = tuple[str, int | None, int | None, float]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def reduce_within(within: Within, points: Sequence[Point]) -> float | None:
    """One evaluation's values of one series reduced to a number (None if none or not finite)."""
    if not points:
        return None
    if within == "one":
        return _finite(points[0][3])
    if within == "abs":
        return _finite(abs(points[0][3]))
    if within == "min":
        return _finite(min(p[3] for p in points))
    if within == "max":  # None when any value is not finite, as the trial summary does
        values = [p[3] for p in points]
        return max(values) if all(math.isfinite(v) for v in values) else None
    if within == "mean":
        return _finite(sum(p[3] for p in points) / len(points))
    return _finite(max(points, key=lambda p: p[1] or 0)[3])  # last_layer


class IntermediateTracker:
    """One trial's reduced evaluations of one summary's source, and its value at a step."""

    def __init__(self, metric: str, plateau_window: int, plateau_rel_tol: float) -> None:
        summary = SUMMARY_BY_NAME.get(metric)
        if summary is None or not summary.intermediate:
            raise ValueError(f"{metric!r} has no intermediate value")
        if summary.over not in ("final", "min", "max", "plateaus"):  # a registry entry out of step
            raise ValueError(f"{metric!r}: no intermediate value over {summary.over!r}")
        self.summary: Summary = summary
        self.window, self.rel_tol = plateau_window, plateau_rel_tol
        self._evals: dict[int, float | None] = {}  # training step -> reduced source value

    def add(self, step: int, points: Iterable[Point]) -> None:
        """Record the evaluation at `step` (step 0, the untrained model, is no training step)."""
        if step < 1:
            return
        source = [p for p in points if p[0] == self.summary.source]
        if source:
            self._evals[step] = reduce_within(self.summary.within, source)

    def value(self, step: int) -> float | None:
        """The summary's value had the trial stopped after the evaluation at `step`."""
        steps = sorted(s for s in self._evals if s <= step)
        if not steps or steps[-1] != step:
            return None
        values = [self._evals[s] for s in steps]
        over = self.summary.over
        if over == "final":
            return values[-1]
        if over in ("min", "max"):  # a running minimum or maximum of the finite values
            finite = [v for v in values if v is not None]
            if not finite:
                return None
            return min(finite) if over == "min" else max(finite)
        # plateaus: defined on a fully finite curve only, as in the trial summary
        losses = [v for v in values if v is not None]
        if len(losses) != len(values):
            return None
        intervals = M.detect_plateaus(steps, losses, self.window, self.rel_tol)
        return float(M.plateau_stats(intervals, steps[-1])[self.summary.name])


def load_tracker(
    metric: str,
    base: TrialConfig,
    params: dict[str, Any],
    rows: Iterable[tuple[int, int, int, float | None]],
) -> IntermediateTracker:
    """A tracker for a trial, with the plateau settings of its config, fed its stored rows
    (step, layer, head, value) of the summary's source series.

    `base` is the study's base TrialConfig; the trial's own parameters are applied to it,
    so a search over `plateau_window` or `plateau_rel_tol` is honoured.
    """
    config = apply_params(base, params)
    tracker = IntermediateTracker(metric, config.plateau_window, config.plateau_rel_tol)
    name = tracker.summary.source
    assert name is not None
    by_step: dict[int, list[Point]] = {}
    for step, layer, head, value in rows:
        by_step.setdefault(step, []).append(
            (
                name,
                None if layer == NO_INDEX else layer,
                None if head == NO_INDEX else head,
                math.nan if value is None else value,
            )
        )
    for step, points in sorted(by_step.items()):
        tracker.add(step, points)
    return tracker
