"""What the study runner does with the trial inbox's batches (see workers/remote.py).

Starts say where and when a task execution began (QUEUED -> RUNNING, `started_at`, Ray
retries counted in `attempts`); reports are stored in one transaction per batch (a crash
leaves whole batches or nothing; replays from a trial's journal are no-ops thanks to the
metric primary key); and each report of the pruned metric goes to Optuna, whose prune
answer travels back through the inbox (`TrialInbox.prune`). Members of a fused group are
trials like any other here: each has its own `Running` entry, rows and pruning.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import optuna
import ray
from sqlalchemy import func, update
from sqlalchemy.orm import Session, sessionmaker

from service.db.ingest import insert_metrics
from service.db.models import NO_INDEX, Trial, TrialState, stored_metric_rows
from service.db.session import session_scope, with_retry
from service.pruning import IntermediateTracker, load_tracker
from service.spec import StudySpec
from workers.remote import Batch, Finished, Report, Start

__all__ = ["Running", "TrialEvents", "take_batches"]

log = logging.getLogger("qkscope.runner")


@dataclass
class Running:
    """A launched trial (alone or a member of a fused group) as the runner tracks it."""

    trial: optuna.Trial
    row_id: int
    number: int
    started: float
    last_step: int = 0
    starts: int = 0  # task executions seen in this runner; Ray retries make it > 1
    reported: set[int] = field(default_factory=set)
    tracker: IntermediateTracker | None = None  # the pruned metric's evaluations so far
    received: dict[str, int] = field(default_factory=dict)  # reports per task execution


def take_batches(stream: Any) -> list[Batch]:
    """Every batch the inbox's stream has ready now (never waits)."""
    batches: list[Batch] = []
    while ray.wait([stream], num_returns=1, timeout=0)[0]:
        try:
            ref = next(stream)
        except StopIteration:
            break
        batches.append(ray.get(ref))
    return batches


class TrialEvents:
    """Stores the starts and reports of the runner's trials and decides pruning. Runs on the
    runner's thread.

    It owns the registry of open trials (`Running` by trial number): the runner `track`s a
    trial when it launches it and `forget`s it when its outcome is recorded, so a report that
    arrives after that (a stream is not ordered with a task's failure) finds no entry: its
    rows are dropped, and Optuna, which already has the trial's outcome, is never asked about
    it.
    """

    def __init__(self, spec: StudySpec, sessions: sessionmaker[Session]) -> None:
        self.spec, self.sessions = spec, sessions
        self._open: dict[int, Running] = {}

    def track(self, entry: Running) -> None:
        self._open[entry.number] = entry

    def forget(self, number: int) -> None:
        self._open.pop(number, None)

    def entry(self, number: int) -> Running | None:
        return self._open.get(number)

    def on_batches(self, batches: list[Batch], inbox: Any) -> list[Finished]:
        """Starts first (they say where and when trials run), then reports in one write;
        returns the slot members' results that arrived (the runner finishes them)."""
        reports: list[Report] = [r for rs, _, _ in batches for r in rs]
        starts: list[Start] = [st for _, sts, _ in batches for st in sts]
        self.record_starts(starts)
        self.persist_reports(reports, inbox)
        return [f for _, _, fs in batches for f in fs]

    def record_starts(self, starts: list[Start]) -> None:
        """Note where and when each task execution began; a second start of one launch is a
        Ray retry. `started_at` is the task's own start time, not the launch time."""
        changes: dict[int, tuple[str, int, float | None]] = {}
        for number, node, at, _execution in starts:
            entry = self._open.get(number)
            if entry is None:
                continue
            entry.starts += 1
            _, retries, first = changes.get(entry.row_id, (node, 0, None))
            retries += 1 if entry.starts > 1 else 0
            changes[entry.row_id] = (node, retries, at if entry.starts == 1 else first)
            if entry.starts > 1:
                log.info("trial %d retried by Ray (execution %d) on %s", number, entry.starts, node)
        if not changes:
            return

        def write() -> None:
            with session_scope(self.sessions) as s:
                for row_id, (node, retries, at) in changes.items():
                    values: dict[str, Any] = {
                        "node": node,
                        "attempts": Trial.attempts + retries,
                        "waiting_reason": None,
                    }
                    if at is not None:  # the first start: keep it across relaunches
                        values["started_at"] = func.coalesce(
                            Trial.started_at, datetime.fromtimestamp(at, UTC)
                        )
                    s.execute(update(Trial).where(Trial.id == row_id).values(**values))
                    s.execute(
                        update(Trial)
                        .where(Trial.id == row_id, Trial.state == TrialState.QUEUED)
                        .values(state=TrialState.RUNNING)
                    )

        with_retry(write, "record starts")

    def persist_reports(self, reports: list[Report], inbox: Any) -> None:
        """One transaction for a batch of reports; primary-key conflicts (replays) are skipped."""
        if not reports:
            return
        rows: list[dict[str, Any]] = []
        last_steps: dict[int, int] = {}
        for number, step, points, execution in reports:
            entry = self._open.get(number)
            if entry is None:
                continue
            entry.received[execution] = entry.received.get(execution, 0) + 1
            for name, layer, head, value in points:
                rows.append(
                    {
                        "trial_id": entry.row_id,
                        "name": name,
                        "step": step,
                        "layer": NO_INDEX if layer is None else layer,
                        "head": NO_INDEX if head is None else head,
                        "value": value if math.isfinite(value) else None,
                    }
                )
            last_steps[entry.row_id] = max(step, last_steps.get(entry.row_id, 0))

        def write() -> None:
            with session_scope(self.sessions) as s:
                insert_metrics(s, rows)
                for row_id, step in last_steps.items():  # never backwards (journal replays)
                    s.execute(
                        update(Trial)
                        .where(Trial.id == row_id, Trial.last_step < step)
                        .values(last_step=step)
                    )
                # Rows that land after the API cancelled their trial are counted too.
                s.execute(
                    update(Trial)
                    .where(Trial.id.in_(last_steps), Trial.state == TrialState.CANCELLED)
                    .values(metric_rows=stored_metric_rows())
                )

        with_retry(write, "persist reports")
        self._prune_decisions(reports, inbox)

    def _prune_decisions(self, reports: list[Report], inbox: Any) -> None:
        if self.spec.pruner.kind == "none":
            return
        metric = self.spec.objectives[0].metric
        for number, step, points, _execution in reports:
            entry = self._open.get(number)
            # step 0 is the untrained model (eval_at_init): nothing to judge a run by yet
            if entry is None or step == 0 or step in entry.reported:
                continue
            if entry.tracker is None:  # rebuilt from stored rows: a resumed trial too
                load = functools.partial(self._load_tracker, entry.row_id, metric)
                entry.tracker = with_retry(load, "load tracker")
            entry.tracker.add(step, points)
            value = entry.tracker.value(step)
            if value is None or not math.isfinite(value):
                continue
            entry.reported.add(step)
            try:
                with_retry(functools.partial(entry.trial.report, value, step), "report")
            except optuna.exceptions.UpdateFinishedTrialError:
                continue  # finished while this report travelled: its outcome stands
            if with_retry(entry.trial.should_prune, "should_prune"):
                inbox.prune.remote(number)

    def _load_tracker(self, row_id: int, metric: str) -> IntermediateTracker:
        with session_scope(self.sessions) as s:
            return load_tracker(s, row_id, metric, self.spec.base)
