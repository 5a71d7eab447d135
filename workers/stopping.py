"""Stopping a trial that can no longer be stable: the study's constraints, checked by the
worker at every evaluation.

A study's constraints say what "stable" means to its user (`min_norm_entropy_ever >= 0.1`).
The service turns each constraint whose metric has an intermediate value into a
`StopRule` and sends it with the trial. At every evaluation the worker computes the summary
the trial would have if it stopped there (the same `summarize` that makes its final
summary) and checks the rules:

- a violation that can never be undone (the metric only moves one way as evaluations go on,
  e.g. a running minimum already below a lower bound; the metric registry says which) stops
  the trial at once: it can never become feasible;
- any other violation stops it once it has held for `patience` evaluations in a row.

The trial then ends as `pruned` with a `stop_reason` such as
"min_norm_entropy_ever 0.0048 < 0.1 at step 50". Deciding on the worker costs no round trip
through the runner, so the trial stops exactly at the evaluation that ruled it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from workers.metric_names import SUMMARY_BY_NAME

__all__ = ["StopRule", "Stopper", "can_recover"]


def can_recover(metric: str, op: Literal[">=", "<="]) -> bool:
    """Whether a violation of `metric op bound` can still be undone by later evaluations,
    from how the registry reduces the metric over evaluations."""
    moves = SUMMARY_BY_NAME[metric].moves
    if moves == "fixed":
        return False
    if moves == "down":  # a running minimum: below a lower bound for good
        return op != ">="
    if moves == "up":  # a running maximum: above an upper bound for good
        return op != "<="
    return True


@dataclass(frozen=True, slots=True)
class StopRule:
    """`metric op bound`; stop once violated for `patience` evaluations in a row (1: at the
    first violating evaluation)."""

    metric: str
    op: Literal[">=", "<="]
    bound: float
    patience: int

    def violated(self, value: float) -> bool:
        return value < self.bound if self.op == ">=" else value > self.bound

    def describe(self, value: float, step: int, held: int) -> str:
        flip = "<" if self.op == ">=" else ">"
        text = f"{self.metric} {value:.4g} {flip} {self.bound:.4g} at step {step}"
        return text if held <= 1 else f"{text} ({held} evaluations in a row)"


class Stopper:
    """One trial's rules and how long each has been violated.

    The counts are part of the trial's checkpoint (`state`, `restore`): a trial resumed
    after a crash, a relaunch or a hand-back goes on counting where its checkpoint left
    off, so that being relaunched never resets a run of violations.
    """

    def __init__(self, rules: list[StopRule]) -> None:
        self.rules = rules
        self._held = [0] * len(rules)

    def state(self) -> list[tuple[tuple[str, str, float, int], int]]:
        """Each rule (as plain values) with its count of violations in a row, for a
        checkpoint."""
        return [
            ((r.metric, r.op, r.bound, r.patience), held)
            for r, held in zip(self.rules, self._held, strict=True)
        ]

    def restore(self, state: list[Any] | None) -> None:
        """The counts a checkpoint saved (`state`); a rule the checkpoint does not name (a
        checkpoint from before counts were saved, another bound) starts from 0."""
        saved = {tuple(rule): int(held) for rule, held in state or []}
        self._held = [saved.get((r.metric, r.op, r.bound, r.patience), 0) for r in self.rules]

    def check(self, step: int, summary: Any) -> str | None:
        """The reason to stop after the evaluation at `step`, given the trial's summary as if
        it stopped there; None to go on. A metric without a value violates nothing."""
        reason = None
        for i, rule in enumerate(self.rules):
            value = getattr(summary, rule.metric, None)
            if value is None or not rule.violated(float(value)):
                self._held[i] = 0
                continue
            self._held[i] += 1
            if reason is None and self._held[i] >= rule.patience:
                reason = rule.describe(float(value), step, self._held[i])
        return reason
