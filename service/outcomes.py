"""A trial's outcome, recorded in our table and told to Optuna: once, and never over a cancel.

The runner hands each finished trial here: a returned result (completed, pruned, diverged,
with its summary), a failure (a reason), or, after a runner restart, an outcome our table
recorded before Optuna heard of it. Ours is the record of truth: a trial our table shows
CANCELLED (the API cancelled the study a moment ago) keeps that state whatever result
arrives late, and Optuna is told what our table says.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import SUMMARY_COLUMNS, Metric, Trial, TrialState, utcnow
from service.db.session import session_scope, with_retry
from service.spec import StudySpec
from service.trial_events import Running
from workers import curves as M

__all__ = ["Outcomes"]

STATES = {
    "completed": TrialState.COMPLETE,
    "pruned": TrialState.PRUNED,
    "diverged": TrialState.DIVERGED,
}


class Outcomes:
    """Records trial outcomes for one study (runs on the runner's thread)."""

    def __init__(
        self,
        spec: StudySpec,
        study: optuna.Study,
        storage: optuna.storages.BaseStorage,
        sessions: sessionmaker[Session],
        study_id: int,
    ) -> None:
        self.spec, self.study, self.storage = spec, study, storage
        self.sessions, self.study_id = sessions, study_id

    def _best_final_val_loss(self) -> float | None:
        """The study's best final validation loss so far: the reference for `trapped`."""

        def read() -> float | None:
            with session_scope(self.sessions) as s:
                return s.scalar(
                    select(func.min(Trial.final_val_loss)).where(
                        Trial.study_id == self.study_id, Trial.state == TrialState.COMPLETE
                    )
                )

        return with_retry(read, "best so far")

    @staticmethod
    def count_metric_rows(s: Session, row_id: int) -> int:
        return int(s.scalar(select(func.count()).where(Metric.trial_id == row_id)) or 0)

    def finish(self, entry: Running, result: dict[str, Any]) -> None:
        """Record a returned trial's outcome and tell Optuna."""
        summary: dict[str, Any] = result["summary"]
        status = summary["status"]
        steps = int(self.spec.base.steps)
        if summary.get("eval_steps") and not summary.get("trapped"):
            ref_loss = self._best_final_val_loss()
            last = summary["eval_steps"][-1]
            final = summary.get("final_val_loss")
            summary["trapped"] = bool(
                final is not None
                and M.is_trapped(
                    [tuple(p) for p in summary.get("plateaus", [])],
                    last,
                    final,
                    ref_loss,
                    float(self.spec.base.trapped_rel_gap),
                )
            )
        constraints = [c.violation(summary, steps) for c in self.spec.constraints] or [0.0]
        values: list[float] = []
        for obj in self.spec.objectives:
            v = summary.get(obj.metric)
            worst = math.inf if obj.direction == "minimize" else -math.inf
            values.append(worst if v is None or status == "diverged" else float(v))
        state = STATES[status]
        recorded = with_retry(
            lambda: self._record_result(entry, result, state, values, constraints), "record result"
        )
        if recorded:
            with_retry(lambda: self.tell(entry, status, state, values, constraints), "tell")

    def tell(
        self,
        entry: Running,
        status: str,
        state: TrialState,
        values: list[float],
        constraints: list[float],
    ) -> None:
        if self.storage.get_trial(entry.trial._trial_id).state.is_finished():
            return  # an earlier try got through before the connection dropped
        for i, (c, v) in enumerate(zip(self.spec.constraints, constraints, strict=False)):
            entry.trial.set_constraint(f"{i}:{c.metric}{c.op}", v)
        entry.trial.set_user_attr("qkscope_status", status)
        if state == TrialState.PRUNED:
            self.study.tell(entry.trial, state=OptunaState.PRUNED, skip_if_finished=True)
        else:
            self.study.tell(entry.trial, values, skip_if_finished=True)

    def tell_recorded(self, trial: optuna.Trial, row: Trial) -> None:
        """Tell Optuna the outcome our table recorded for a finished trial (runner restart)."""
        summary = row.summary or {}
        steps = int(self.spec.base.steps)
        constraints = [c.violation(summary, steps) for c in self.spec.constraints] or [0.0]
        values = [
            (math.inf if o.direction == "minimize" else -math.inf) if v is None else float(v)
            for o, v in zip(
                self.spec.objectives, row.values or [None] * len(self.spec.objectives), strict=False
            )
        ]
        entry = Running(trial=trial, row_id=row.id, number=row.number, started=time.monotonic())
        status = str(summary.get("status", "completed"))
        state = TrialState(row.state)
        with_retry(lambda: self.tell(entry, status, state, values, constraints), "tell recorded")

    def _record_result(
        self,
        entry: Running,
        result: dict[str, Any],
        state: TrialState,
        values: list[float],
        constraints: list[float],
    ) -> bool:
        """Write the outcome; False when the row was cancelled first (it stays cancelled)."""
        summary: dict[str, Any] = result["summary"]
        with session_scope(self.sessions) as s:
            row = s.get(Trial, entry.row_id)
            assert row is not None
            if row.state == TrialState.CANCELLED:
                row.metric_rows = self.count_metric_rows(s, entry.row_id)
                return False
            row.state = state
            row.summary = summary
            row.node = result.get("node")
            row.values = [v if math.isfinite(v) else None for v in values]
            row.value = row.values[0]
            row.feasible = all(c <= 0 for c in constraints)
            for col in SUMMARY_COLUMNS:
                setattr(row, col, summary.get(col))
            row.last_step = max(row.last_step or 0, int(summary.get("steps_done", 0)))
            row.finished_at = utcnow()
            row.duration_s = time.monotonic() - entry.started
            if result.get("started_at") and result.get("finished_at"):  # the task's own clock
                started = datetime.fromtimestamp(float(result["started_at"]), UTC)
                row.started_at = row.started_at or started
                row.finished_at = datetime.fromtimestamp(float(result["finished_at"]), UTC)
                row.duration_s = float(result["finished_at"]) - float(result["started_at"])
            row.waiting_reason = None
            row.metric_rows = self.count_metric_rows(s, entry.row_id)
            return True

    def fail(self, entry: Running, reason: str) -> None:
        """Record a failure (unless the row was cancelled first) and tell Optuna FAIL."""

        def write() -> None:
            with session_scope(self.sessions) as s:
                row = s.get(Trial, entry.row_id)
                assert row is not None
                if row.state != TrialState.CANCELLED:
                    row.state, row.error, row.finished_at = TrialState.FAILED, reason, utcnow()
                    row.duration_s = time.monotonic() - entry.started
                row.metric_rows = self.count_metric_rows(s, entry.row_id)

        with_retry(write, "record failure")
        with_retry(
            lambda: self.study.tell(entry.trial, state=OptunaState.FAIL, skip_if_finished=True),
            "tell failure",
        )
