"""What the runner writes and asks for what its workers said (the scheduler has already
updated the records: service/runner/scheduler.py, `Scheduler.postprocess`).

Starts say where and when an execution began (QUEUED -> RUNNING, `started_at`, a second
execution of one trial counted in `attempts`). Reports are stored in one transaction per
batch (a crash leaves whole batches or nothing; replays from a trial's journal are no-ops
thanks to the metric primary key). The intermediate value a report carries (its worker
computed it: the trial's summary of the pruned objective had it stopped there) goes to
Optuna's pruner, whose "stop", with its reason, travels back to the trial through the inbox
and ends it PRUNED with that reason; every judged report is marked so (`judged`), which
answers the verdict the trial's worker waits for between steps (workers/inbox.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from service.runner.records import TrialRecord
from service.runner.search import Search
from service.spec import StudySpec
from service.store import MetricRow, StartRow, TrialRows
from workers.messages import Report, Started

__all__ = ["Reports"]

log = logging.getLogger("qkscope.runner")


class Reports:
    """Stores starts and reports; asks the pruner and stops the trials it prunes."""

    def __init__(
        self,
        spec: StudySpec,
        trials: TrialRows,
        search: Search,
        stop_trial: Callable[[int, str], None],
        judged: Callable[[dict[int, int]], None] | None = None,
    ) -> None:
        """`stop_trial(number, reason)` stops a pruned trial; `judged({number: step})` tells
        the trials waiting for a verdict that their reports up to that step were judged."""
        self.spec, self.trials, self.search = spec, trials, search
        self.stop_trial = stop_trial
        self.judged = judged

    def record_starts(self, started: list[tuple[Started, TrialRecord]]) -> None:
        """The starts the scheduler accepted (each record's `starts` already counted)."""
        changes: dict[int, StartRow] = {}
        for msg, rec in started:
            prev = changes.get(rec.row_id)
            first = msg.at if rec.starts == 1 else (prev.first_at if prev else None)
            changes[rec.row_id] = StartRow(msg.node, rec.attempts_before + rec.starts, first)
            if rec.starts > 1:
                log.info(
                    "trial %d started again (execution %d) on %s", rec.number, rec.starts, msg.node
                )
        self.trials.record_starts(changes)

    def store(self, reports: list[tuple[Report, TrialRecord]]) -> None:
        """Store a batch of evaluations of trials the runner still holds."""
        rows: list[MetricRow] = [
            (rec.row_id, msg.step, *p) for msg, rec in reports for p in msg.points
        ]
        self.trials.store_reports(rows)

    def store_after_end(self, reports: list[tuple[Report, int]]) -> None:
        """Store reports that came after their trial's outcome was recorded (more than
        FLUSH_TIMEOUT_S after its end: Ray runs an async actor's calls out of order), on the
        trial's row (`row_id`); the store recounts that row's `metric_rows`, so the count
        stays the rows stored. Logged: it means the inbox lagged that long."""
        if not reports:
            return
        rows: list[MetricRow] = [
            (row_id, msg.step, *p) for msg, row_id in reports for p in msg.points
        ]
        self.trials.store_reports(rows)
        per_trial: dict[int, int] = {}
        for msg, _ in reports:
            per_trial[msg.trial] = per_trial.get(msg.trial, 0) + 1
        for number, n in sorted(per_trial.items()):
            log.warning(
                "trial %d: %d report(s) came after its outcome was recorded; stored", number, n
            )

    def prune(self, values: list[tuple[TrialRecord, int, float]]) -> None:
        """Hand each (trial, step, value) to Optuna's pruner; stop those it prunes, with why
        (a stop sent twice keeps its first reason)."""
        if self.spec.pruner.kind == "none":
            return
        kind, metric = self.spec.pruner.kind, self.spec.objectives[0].metric
        steps: dict[int, int] = {}
        for rec, step, value in values:
            if self.search.report(rec.trial, step, value):
                self.stop_trial(rec.number, f"{kind} pruner: {metric} {value:.4g} at step {step}")
            steps[rec.number] = max(step, steps.get(rec.number, step))
        if steps and self.judged is not None:
            self.judged(steps)  # after the stops: a verdict then reads the stop
