"""A trial's result judged against its study: its state, objective values, constraint
violations, and whether it ended trapped on a plateau.

A worker's summary knows only its own trial; `trapped` also needs the study's best final
loss so far, so it is judged here. The worker's summary is never changed: the stored
summary is a copy with the study's verdict in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.spec import StudySpec
from service.store import (
    Outcome,
    ResultRow,
    TrialState,
    constraint_values,
    objective_values,
    stored_outcome,
)
from workers import curves as M
from workers.config import TrialStatus, TrialSummary
from workers.messages import Stopped

__all__ = ["STATES", "Judged", "judge", "judge_stored", "result_row"]

STATES = {
    TrialStatus.COMPLETED: TrialState.COMPLETE,
    TrialStatus.PRUNED: TrialState.PRUNED,
    TrialStatus.DIVERGED: TrialState.DIVERGED,
}


@dataclass(frozen=True, slots=True)
class Judged:
    status: str  # the worker's: completed, pruned, diverged
    state: TrialState
    summary: dict[str, Any]  # as stored
    values: list[float]  # objective values (the worst value where there is none)
    constraints: list[float]  # Optuna's convention: <= 0 is feasible

    @property
    def feasible(self) -> bool:
        return all(c <= 0 for c in self.constraints)

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.status, self.state, self.values, self.constraints)


def _values(spec: StudySpec, summary: dict[str, Any], diverged: bool) -> list[float]:
    return objective_values(
        spec, [None if diverged else summary.get(o.metric) for o in spec.objectives]
    )


def judge(
    spec: StudySpec,
    summary: TrialSummary,
    best_loss: Callable[[], float | None],
    steps: int | None = None,
) -> Judged:
    """A returned trial's outcome; `best_loss` reads the study's best final validation loss
    (only when `trapped` needs it); `steps`: the trial's own (a searched `steps`), what a
    constraint's `fraction_of_steps` is a fraction of. A pruned trial's stop reason is its
    worker's (the pruner's, which travelled with the stop, or an unmeetable constraint's);
    one stopped by a version that sent no reason is said to be the pruner's."""
    stored = summary.model_dump(mode="json")
    if summary.status == TrialStatus.PRUNED and not summary.stop_reason:
        stored["stop_reason"] = f"{spec.pruner.kind} pruner"
    if summary.eval_steps and not summary.trapped:
        final = summary.final_val_loss
        stored["trapped"] = bool(
            final is not None
            and M.is_trapped(
                [(int(a), int(b)) for a, b in summary.plateaus],
                summary.eval_steps[-1],
                final,
                best_loss(),
                float(spec.base.trapped_rel_gap),
            )
        )
    status = summary.status
    return Judged(
        status,
        STATES[status],
        stored,
        _values(spec, stored, status == TrialStatus.DIVERGED),
        constraint_values(spec, stored, steps),
    )


def judge_stored(
    spec: StudySpec,
    state: TrialState,
    summary: dict[str, Any] | None,
    values: list[Any] | None,
    params: dict[str, Any] | None = None,
) -> Judged:
    """The outcome our table recorded (told to Optuna after a runner restart)."""
    o = stored_outcome(spec, state, summary, values, params)
    return Judged(o.status, state, summary or {}, o.values, o.constraints)


def result_row(judged: Judged, end: Stopped, duration_s: float) -> ResultRow:
    return ResultRow(
        state=judged.state,
        summary=judged.summary,
        node=end.node,
        values=judged.values,
        feasible=judged.feasible,
        last_step=int(judged.summary.get("steps_done", 0)),
        started_at=end.started_at,
        finished_at=end.finished_at,
        duration_s=duration_s,
    )
