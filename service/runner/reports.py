"""What the runner does with the starts and evaluations its workers send.

Starts say where and when an execution began (QUEUED -> RUNNING, `started_at`, a second
execution of one trial counted in `attempts`). Reports are stored in one transaction per
batch (a crash leaves whole batches or nothing; replays from a trial's journal are no-ops
thanks to the metric primary key), and each evaluation of the pruned metric goes to
Optuna, whose answer travels back to the trial through the inbox. A report whose trial has
no record any more (its outcome is recorded; a stream is not ordered with an end) is
dropped, and Optuna, which has the outcome already, is never asked about it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

from service.runner.pruning import load_tracker
from service.runner.records import TrialRecord
from service.runner.search import Search
from service.spec import StudySpec
from service.store.trials import MetricRow, StartRow, TrialRows
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
        stop_trial: Callable[[int], None],
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
            # step 0 is the untrained model (eval_at_init): nothing to judge a run by yet
            if msg.step == 0 or msg.step in rec.reported:
                continue
            tracker = rec.trackers.get(metric)
            if tracker is None:  # rebuilt from stored rows: a resumed trial too
                params, rows = self.trials.metric_points(rec.row_id, _source(metric))
                tracker = rec.trackers[metric] = load_tracker(metric, self.spec.base, params, rows)
            tracker.add(msg.step, msg.points)
            value = tracker.value(msg.step)
            if value is None or not math.isfinite(value):
                continue
            rec.reported.add(msg.step)
            if self.search.report(rec.trial, msg.step, value) and rec.prune_reason is None:
                kind = self.spec.pruner.kind
                rec.prune_reason = f"{kind} pruner: {metric} {value:.4g} at step {msg.step}"
                self.stop_trial(rec.number)


def _source(metric: str) -> str:
    from workers.metric_names import SUMMARY_BY_NAME

    source = SUMMARY_BY_NAME[metric].source
    assert source is not None
    return source
