"""What the runner does with the starts and evaluations its workers send.

Starts say where and when an execution began (QUEUED -> RUNNING, `started_at`, a second
execution of one trial counted in `attempts`). Reports are stored in one transaction per
batch (a crash leaves whole batches or nothing; replays from a trial's journal are no-ops
thanks to the metric primary key), and the intermediate value each report carries (its
worker computed it) goes to Optuna's pruner, whose "stop", with its reason, travels back
to the trial through the inbox. A report whose trial has
no record any more (its outcome is recorded; a stream is not ordered with an end) is
dropped, and Optuna, which has the outcome already, is never asked about it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

from service.runner.records import TrialRecord
from service.runner.search import Search
from service.spec import StudySpec
from service.store import MetricRow, StartRow, TrialRows
from workers.messages import Report, Started

__all__ = ["Reports"]

log = logging.getLogger("qkscope.runner")


class Reports:
    """Stores starts and reports and answers whether a trial should stop."""

    def __init__(
        self,
        spec: StudySpec,
        trials: TrialRows,
        search: Search,
        stop_trial: Callable[[int, str], None],
    ) -> None:
        self.spec, self.trials, self.search = spec, trials, search
        self.stop_trial = stop_trial

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

    def store(self, reports: list[Report], records: Mapping[int, TrialRecord]) -> None:
        """Store a batch of evaluations, then decide on stopping the trials that sent them."""
        rows: list[MetricRow] = []
        mine: list[tuple[Report, TrialRecord]] = []
        for msg in reports:
            rec = records.get(msg.trial)
            if rec is None:
                continue
            rec.received[msg.execution] = rec.received.get(msg.execution, 0) + 1
            rows += [(rec.row_id, msg.step, *p) for p in msg.points]
            mine.append((msg, rec))
        self.trials.store_reports(rows)
        self._decide(mine)

    def _decide(self, reports: list[tuple[Report, TrialRecord]]) -> None:
        if self.spec.pruner.kind == "none":
            return
        metric = self.spec.objectives[0].metric
        for msg, rec in reports:
            # step 0 (the untrained model) has no value; a replayed step was told already
            value = msg.value
            if value is None or not math.isfinite(value) or msg.step in rec.reported:
                continue
            rec.reported.add(msg.step)
            if self.search.report(rec.trial, msg.step, value) and not rec.stopping:
                rec.stopping = True
                kind = self.spec.pruner.kind
                self.stop_trial(
                    rec.number, f"{kind} pruner: {metric} {value:.4g} at step {msg.step}"
                )
