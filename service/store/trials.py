"""Trial rows and their metric rows: queued, started, reported, and ended once.

A trial row is written QUEUED right after Optuna's ask, RUNNING when its worker says it
started, and ended exactly once (COMPLETE, PRUNED, DIVERGED, FAILED, CANCELLED). Every
ending is an `UPDATE ... WHERE state IN (QUEUED, RUNNING)`: whoever ends a trial first (the
runner with a result, the API with a cancel) wins, and a late writer changes nothing but the
count of stored metric rows. Metric rows go in one transaction per batch; a replayed report
is a no-op (the metric primary key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import optuna
from sqlalchemy import case, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.spec import StudySpec
from service.store.ingest import insert_metrics
from service.store.models import (
    CURRENT_PENALTY_VERSION,
    NO_INDEX,
    OPEN_TRIAL_STATES,
    SUMMARY_COLUMNS,
    Study,
    Trial,
    TrialState,
    stored_metric_rows,
    utcnow,
)
from service.store.optuna import Outcome, close_optuna_trials, stored_outcome
from service.store.rows import Rows
from service.store.session import session_scope, with_retry

__all__ = ["RESULT_STATES", "MetricRow", "ResultRow", "StartRow", "TrialRows"]

# The endings with a result (told to Optuna as recorded); FAILED and CANCELLED have none.
RESULT_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED)

# (name, layer, head, value) of one stored number; layer/head None where it has none.
MetricRow = tuple[int, int, str, int | None, int | None, float]  # (row id, step, *point)


@dataclass(frozen=True, slots=True)
class StartRow:
    """A task execution of a trial began: where, and (first one only) when."""

    node: str
    attempts: int  # executions so far, this one included (absolute: a rewrite changes nothing)
    first_at: float | None  # unix time of the first execution, None if not in this batch


@dataclass(frozen=True, slots=True)
class ResultRow:
    """A trial's ending with a result, as stored."""

    state: TrialState
    summary: dict[str, Any]
    node: str | None
    values: list[float]
    feasible: bool
    last_step: int
    started_at: float | None  # the worker's own clock (unix time)
    finished_at: float | None
    duration_s: float  # used when the worker gave no times


class TrialRows(Rows):
    """The writes of `qk_trial` and `qk_metric` (and the reads their writers need).

    Who owns a trial: the study's current runner inserts it (QUEUED), starts it (RUNNING)
    and ends it with a result or a failure; a new runner attempt takes over a dead one's
    RUNNING trials (`claim_orphan`). Anyone else ends a study's open trials only through
    `finish_open` (a cancel, a give-up, the reconciler closing an ended study). An ending
    only matches a QUEUED or RUNNING row, so the first ending wins.

    Every method but `recorded_numbers` is *retried* (`with_retry`: run again after a
    dropped connection or a locked database, each safe to repeat) and raises
    `DatabaseUnavailable` once the database stayed away for the outage window
    (`outage_window`: a runner's `db_outage_s`, else 24 s). With a `fence` (a study
    runner's), every write holds only while its attempt is current: otherwise it changes
    nothing and raises `Superseded` (service/store/fence.py).
    """

    # ---- queued and started ----------------------------------------------------------------

    def insert_queued(self, study_id: int, number: int, params: dict[str, Any], seed: int) -> int:
        """Insert the QUEUED row of a trial Optuna just asked. Retried; fenced.

        Returns:
            The row id; the existing row's id when a retry finds the row the lost try
            committed (nothing inserted then).

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """

        def write(s: Session) -> int:
            found = s.scalar(
                select(Trial.id).where(Trial.study_id == study_id, Trial.number == number)
            )
            if found is not None:
                return int(found)
            row = Trial(
                study_id=study_id,
                number=number,
                params=params,
                seed=seed,
                penalty_version=CURRENT_PENALTY_VERSION,
                state=TrialState.QUEUED,
            )
            s.add(row)
            s.flush()
            return row.id

        return self._tx(write, "insert trial")

    def claim_orphan(self, study_id: int, number: int, runner: int) -> Trial | None:
        """A dead runner's trial, claimed by runner attempt `runner`: if RUNNING, its
        `attempts` count once (a retry after a lost commit counts nothing) and `claimed_by`
        becomes `runner`; a row in any other state is unchanged. Retried; fenced.

        Returns:
            The row (detached, any state), or None if the trial has no row.

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """

        def claim(s: Session) -> Trial | None:
            mine = (Trial.study_id == study_id, Trial.number == number)
            s.execute(
                update(Trial)
                .where(*mine, Trial.state == TrialState.RUNNING)
                .where(or_(Trial.claimed_by.is_(None), Trial.claimed_by != runner))
                .values(attempts=Trial.attempts + 1, claimed_by=runner)
            )
            return s.scalars(select(Trial).where(*mine)).one_or_none()

        return self._tx(claim, "claim orphan")

    def recorded_numbers(self, study_id: int, numbers: list[int]) -> set[int]:
        """Which of the trial `numbers` have a row. Run once (not retried); writes nothing."""
        with session_scope(self.sessions) as s:
            return set(
                s.scalars(
                    select(Trial.number).where(
                        Trial.study_id == study_id, Trial.number.in_(numbers)
                    )
                )
            )

    def record_starts(self, starts: dict[int, StartRow]) -> None:
        """Where each trial (row id) runs; QUEUED becomes RUNNING. Changes only open rows
        (`node`, `attempts`, `started_at` of the first start, `waiting_reason`); `attempts`
        never goes down, and writing the same starts again (a retry after a lost commit)
        changes nothing. Retried; fenced.

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """
        if not starts:
            return

        def write(s: Session) -> None:
            for row_id, st in starts.items():
                values: dict[str, Any] = {
                    "node": st.node,
                    "attempts": case(
                        (Trial.attempts < st.attempts, st.attempts), else_=Trial.attempts
                    ),
                    "waiting_reason": None,
                }
                if st.first_at is not None:  # the first start: kept across relaunches
                    values["started_at"] = func.coalesce(
                        Trial.started_at, datetime.fromtimestamp(st.first_at, UTC)
                    )
                open_row = (Trial.id == row_id, Trial.state.in_(OPEN_TRIAL_STATES))
                s.execute(update(Trial).where(*open_row).values(**values))
                s.execute(
                    update(Trial)
                    .where(Trial.id == row_id, Trial.state == TrialState.QUEUED)
                    .values(state=TrialState.RUNNING)
                )

        self._tx(write, "record starts")

    # ---- reports -----------------------------------------------------------------------------

    def store_reports(self, rows: list[MetricRow]) -> None:
        """One transaction for a batch of metric rows: inserts `qk_metric` rows (replays
        are skipped), raises each trial's `last_step` (never backwards), and recounts
        `metric_rows` on those of its trials that have ended (rows that land after a cancel,
        or after the trial's result: a report the inbox delivered late), so that an ended
        trial's count is always the rows stored. Retried; fenced.

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """
        if not rows:
            return
        last: dict[int, int] = {}
        dicts = []
        for row_id, step, name, layer, head, value in rows:
            dicts.append(
                {
                    "trial_id": row_id,
                    "name": name,
                    "step": step,
                    "layer": NO_INDEX if layer is None else layer,
                    "head": NO_INDEX if head is None else head,
                    "value": value if math.isfinite(value) else None,
                }
            )
            last[row_id] = max(step, last.get(row_id, 0))

        def write(s: Session) -> None:
            insert_metrics(s, dicts)
            for row_id, step in last.items():
                s.execute(
                    update(Trial)
                    .where(Trial.id == row_id, Trial.last_step < step)
                    .values(last_step=step)
                )
            s.execute(
                update(Trial)
                .where(Trial.id.in_(last), Trial.state.not_in(OPEN_TRIAL_STATES))
                .values(metric_rows=stored_metric_rows())
            )

        self._tx(write, "persist reports")

    # ---- endings -----------------------------------------------------------------------------

    def _end(self, row_id: int, values: dict[str, Any]) -> bool:
        """End an open row with `values`; else (ended first) only recount its metric rows."""

        def write(s: Session) -> bool:
            open_row = (Trial.id == row_id, Trial.state.in_(OPEN_TRIAL_STATES))
            n = s.execute(update(Trial).where(*open_row).values(**values)).rowcount  # type: ignore[attr-defined]
            s.execute(
                update(Trial).where(Trial.id == row_id).values(metric_rows=stored_metric_rows())
            )
            return bool(n)

        return self._tx(write, "end trial")

    def record_result(self, row_id: int, r: ResultRow) -> bool:
        """Store a returned trial's outcome on its row, if the row is still open (QUEUED or
        RUNNING); the row's `metric_rows` is recounted either way. Retried; fenced.

        Returns:
            Whether the row was ended here (False: it had ended first, e.g. a cancel).

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """
        values: dict[str, Any] = {
            "state": r.state,
            "summary": r.summary,
            "node": r.node,
            "values": [v if math.isfinite(v) else None for v in r.values],
            "feasible": r.feasible,
            "last_step": case((Trial.last_step > r.last_step, Trial.last_step), else_=r.last_step),
            "waiting_reason": None,
            "stop_reason": r.summary.get("stop_reason"),
            "finished_at": utcnow(),
            "duration_s": r.duration_s,
        }
        values["value"] = values["values"][0]
        values.update({col: r.summary.get(col) for col in SUMMARY_COLUMNS})
        if r.started_at is not None and r.finished_at is not None:  # the worker's own clock
            started = datetime.fromtimestamp(r.started_at, UTC)
            values["started_at"] = func.coalesce(Trial.started_at, started)
            values["finished_at"] = datetime.fromtimestamp(r.finished_at, UTC)
            values["duration_s"] = r.finished_at - r.started_at
        return self._end(row_id, values)

    def record_failure(self, row_id: int, reason: str, duration_s: float) -> bool:
        """FAILED with `reason`, if the row is still open; as `record_result` (retried,
        fenced; same return value and errors)."""
        return self._end(
            row_id,
            {
                "state": TrialState.FAILED,
                "error": reason,
                "finished_at": utcnow(),
                "duration_s": duration_s,
                "waiting_reason": None,
            },
        )

    def finish_open(
        self,
        study_id: int,
        state: TrialState,
        reason: str,
        storage: optuna.storages.BaseStorage | None,
    ) -> int:
        """The one way a study's unfinished trials end without a result (cancel, give up):
        our QUEUED/RUNNING rows become `state` with `reason`, and (with `storage`) the
        study's RUNNING Optuna trials FAIL, so that no Optuna trial stays RUNNING for good.
        Trials that finished meanwhile keep their result in both. Three retried steps: our
        rows (one fenced transaction), then the recorded outcomes, then Optuna's trials
        (unfenced: after the fenced write committed).

        Returns:
            How many of our rows it closed.

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window; if in a
                later step, our rows stay closed and Optuna's RUNNING trials open (for a
                FAILED or CANCELLED study, `StudyRows.ended_with_open_trials` finds them).
        """

        def write(s: Session) -> int:
            closed = s.execute(
                update(Trial)
                .where(Trial.study_id == study_id, Trial.state.in_(OPEN_TRIAL_STATES))
                .values(
                    state=state,
                    finished_at=utcnow(),
                    error=reason,
                    waiting_reason=None,
                    metric_rows=stored_metric_rows(),
                )
            ).rowcount  # type: ignore[attr-defined]
            return int(closed or 0)

        closed = self._tx(write, "close open trials")
        if storage is not None:
            spec, recorded = with_retry(
                lambda: recorded_outcomes(self.sessions, study_id), "recorded outcomes"
            )
            with_retry(
                lambda: close_optuna_trials(storage, study_id, state.value.lower(), spec, recorded),
                "close Optuna trials",
            )
        return closed

    def recount(self, row_ids: list[int]) -> None:
        """Count the metric rows stored now on those of `row_ids` that are CANCELLED (after
        the runner's last batch); changes only their `metric_rows`. Retried; fenced.

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """

        def write(s: Session) -> None:
            s.execute(
                update(Trial)
                .where(Trial.id.in_(row_ids), Trial.state == TrialState.CANCELLED)
                .values(metric_rows=stored_metric_rows())
            )

        self._tx(write, "count cancelled rows")

    def best_final_val_loss(self, study_id: int) -> float | None:
        """The study's best final validation loss so far (the reference for `trapped`), over
        its COMPLETE rows. Retried; unfenced; writes nothing.

        Returns:
            The smallest `final_val_loss`, or None when no trial completed with one.

        Raises:
            DatabaseUnavailable: The database stayed away for the outage window.
        """

        def read(s: Session) -> float | None:
            return s.scalar(
                select(func.min(Trial.final_val_loss)).where(
                    Trial.study_id == study_id, Trial.state == TrialState.COMPLETE
                )
            )

        return self._tx(read, "best so far", fenced=False)


def recorded_outcomes(
    sessions: sessionmaker[Session], study_id: int
) -> tuple[StudySpec, dict[int, Outcome]]:
    """The study's spec and the outcomes of its trials that ended with a result (by trial
    number): what a cancel or a give-up tells Optuna for those still RUNNING there."""
    with session_scope(sessions) as s:
        spec = StudySpec.model_validate(s.scalar(select(Study.spec).where(Study.id == study_id)))
        rows = s.execute(
            select(Trial.number, Trial.state, Trial.summary, Trial.values, Trial.params).where(
                Trial.study_id == study_id, Trial.state.in_(RESULT_STATES)
            )
        ).all()
    return spec, {
        n: stored_outcome(spec, TrialState(st), summary, values, params)
        for n, st, summary, values, params in rows
    }
