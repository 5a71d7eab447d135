"""Study rows: created PENDING, launched, RUNNING, and ended (COMPLETED, FAILED, CANCELLED).

Every write is one transaction and conditional on the state it changes: a terminal status
is never left (an update only matches a live row), a launch is claimed only if nobody
launched the study since the caller looked, and its job id is recorded in the same
transaction, before the job is submitted (so a submission whose answer was lost is found by
that id, never submitted a second time). Attempt numbers only go up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    Row,
    Select,
    String,
    cast,
    column,
    inspect,
    literal_column,
    or_,
    select,
    table,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.spec import StudySpec
from service.store.models import (
    OPEN_TRIAL_STATES,
    Study,
    StudyStatus,
    Trial,
    TrialState,
    utcnow,
)
from service.store.optuna import optuna_study_name
from service.store.rows import Rows
from service.store.session import session_scope
from service.store.standbys import claim as claim_standby

__all__ = ["LIVE", "RAY_UNREACHABLE", "TERMINAL", "Charge", "StudyRows"]

LIVE = (StudyStatus.PENDING, StudyStatus.RUNNING)
TERMINAL = (StudyStatus.COMPLETED, StudyStatus.FAILED, StudyStatus.CANCELLED)
# Starts every waiting_reason written while Ray's job server does not answer, so that the
# reason is cleared once it answers again without touching the runner's own reasons.
RAY_UNREACHABLE = "Ray cluster unreachable"


class Charge(StrEnum):
    """What the death of a study's previous runner job is charged to when it is relaunched
    (`StudyRows.claim_launch`)."""

    FAILURE = "failure"  # the study or the cluster: bounded by max_job_attempts
    WEATHER = "weather"  # the database away: bounded by max_weather_relaunches


# A study's RUNNING trials in Optuna's own tables (`studies`, `trials`: Optuna's schema, read
# only here, never written), for `ended_with_open_trials`.
_optuna_running: Select[tuple[Any]] = (
    select(literal_column("1"))
    .select_from(table("trials", column("study_id"), column("state")))
    .join(
        table("studies", column("study_id"), column("study_name")),
        literal_column("studies.study_id") == literal_column("trials.study_id"),
    )
    .where(
        literal_column("studies.study_name") == Study.optuna_study_name,
        cast(literal_column("trials.state"), String) == "RUNNING",  # an enum in PostgreSQL
    )
)


def _has_optuna_tables(s: Session) -> bool:
    """Whether Optuna created its tables yet (no study ever ran: not yet)."""
    names = inspect(s.connection()).get_table_names()
    return "trials" in names and "studies" in names


def _first_line(e: object, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


class StudyRows(Rows):
    """The writes of `qk_study` (and the reads its writers need).

    Each method is one transaction. Those marked *retried* run under `with_retry`: after a
    dropped connection or a locked database they run again (each is safe to repeat), and
    they raise `DatabaseUnavailable` once the database stayed away for the outage window
    (`outage_window`: a runner's `db_outage_s`, else 24 s); a deadlock or another transient
    error is re-raised after 24 s at most. The others (the API's and the reconciler's) run
    once: a database error propagates as SQLAlchemy raised it, the transaction rolled back.

    With a `fence` (a study runner's), the writes a runner makes (`set_status`,
    `fail_live`, `set_waiting_reason`, `check_current`) hold only while its attempt is
    current: otherwise they change nothing and raise `Superseded`
    (service/store/fence.py). The launch methods are not fenced: claiming an attempt is
    what moves the fence.
    """

    # ---- creation ------------------------------------------------------------------------

    def create(self, spec: StudySpec, idempotency_key: str | None = None) -> tuple[Study, bool]:
        """Insert a PENDING study, or return the one an earlier request with the same
        idempotency key created (two concurrent POSTs race on the unique index: the loser
        reads the winner's row). A ready standby row is claimed instead of inserting one
        (service/store/standbys.py): the study then already has its job id and attempt 1,
        and its runner is waiting for it. Run once; unfenced.

        Returns:
            The row (detached), and whether this call inserted it.

        Raises:
            sqlalchemy.exc.IntegrityError: Without an idempotency key, if the insert breaks
                a constraint.
        """
        try:
            return self._insert(spec, idempotency_key)
        except IntegrityError:
            if not idempotency_key:
                raise
            with session_scope(self.sessions) as s:
                row = s.scalars(select(Study).where(Study.idempotency_key == idempotency_key))
                return row.one(), False

    def _insert(self, spec: StudySpec, idempotency_key: str | None) -> tuple[Study, bool]:
        with session_scope(self.sessions) as s:
            if idempotency_key:
                existing = s.scalars(
                    select(Study).where(Study.idempotency_key == idempotency_key)
                ).one_or_none()
                if existing is not None:
                    return existing, False
            values = {
                "name": spec.name,
                "spec": spec.model_dump(mode="json", by_alias=True),
                "n_trials": spec.budget.n_trials,
                "idempotency_key": idempotency_key,
            }
            if (claimed := claim_standby(s, values)) is not None:
                return claimed, True  # its runner job is already up (store/standbys.py)
            row = Study(**values, status=StudyStatus.PENDING, optuna_study_name="")
            s.add(row)
            s.flush()
            row.optuna_study_name = optuna_study_name(row.id)
            return row, True

    def get(self, study_id: int) -> Study | None:
        """Read the study row (detached), or None if there is none. Run once; writes
        nothing."""
        with session_scope(self.sessions) as s:
            return s.get(Study, study_id)

    # ---- status --------------------------------------------------------------------------

    def set_status(self, study_id: int, status: StudyStatus, error: str | None = None) -> bool:
        """Move a live (PENDING or RUNNING) study to `status`; a terminal status (a cancel)
        is never left. Changes only the study row: `status`, `finished_at` for a terminal
        one, `error` if given, `started_at` the first time it is RUNNING. Retried; fenced.

        Returns:
            Whether the row changed (False: the study had ended already).

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """
        values: dict[str, Any] = {"status": status}
        if status in TERMINAL:
            values["finished_at"] = utcnow()
        if error:
            values["error"] = error

        def write(s: Session) -> bool:
            q = update(Study).where(Study.id == study_id, Study.status.in_(LIVE))
            changed = s.execute(q.values(**values)).rowcount  # type: ignore[attr-defined]
            if status == StudyStatus.RUNNING:
                s.execute(
                    update(Study)
                    .where(Study.id == study_id, Study.started_at.is_(None))
                    .values(started_at=utcnow())
                )
            return bool(changed)

        return self._tx(write, "set study status")

    def check_current(self) -> None:
        """Check that this store's fence is the study's current attempt (before a write
        elsewhere: an Optuna ask). Changes nothing; no-op without a fence. Retried.

        Raises:
            Superseded: The fence is stale.
            DatabaseUnavailable: The database stayed away for the outage window.
        """
        if self.fence is not None:
            self._tx(lambda s: None, "check fence")

    def status(self, study_id: int) -> StudyStatus | None:
        """Read the study's status. Retried; unfenced; writes nothing.

        Returns:
            The status, or None if there is no such study.

        Raises:
            DatabaseUnavailable: The database stayed away for the outage window.
        """

        def read(s: Session) -> StudyStatus | None:
            v = s.scalar(select(Study.status).where(Study.id == study_id))
            return None if v is None else StudyStatus(v)

        return self._tx(read, "read study status", fenced=False)

    def cancel(self, study_id: int) -> tuple[Study | None, str | None]:
        """Mark a live study CANCELLED (`finished_at` set, `waiting_reason` cleared). Its
        trials are left to `TrialRows.finish_open`. Run once; unfenced.

        Returns:
            The row (None: no such study) and the Ray job id to stop (None when the study
            had ended already: a cancel of an ended study changes nothing).
        """
        with session_scope(self.sessions) as s:
            changed = s.execute(
                update(Study)
                .where(Study.id == study_id, Study.status.in_(LIVE))
                .values(status=StudyStatus.CANCELLED, finished_at=utcnow(), waiting_reason=None)
            ).rowcount  # type: ignore[attr-defined]
            row = s.get(Study, study_id)
            return row, (row.ray_job_id if row is not None and changed else None)

    def fail_live(self, study_id: int, reason: str) -> bool:
        """FAILED with `reason`, unless the study ended meanwhile: `set_status` (retried,
        fenced; same return value and errors). Its trials are left to `finish_open`."""
        return self.set_status(study_id, StudyStatus.FAILED, reason)

    # ---- launching -----------------------------------------------------------------------

    def claim_launch(
        self,
        study_id: int,
        seen_attempts: int | None,
        job_id_for: Callable[[int, int], str],
        charge: Charge | None = None,
    ) -> tuple[int, str] | None:
        """Claim the next runner-job attempt of a live study and record its job id, in one
        transaction: `job_attempts` + 1 (which supersedes every earlier attempt's fence),
        `ray_job_id` = `job_id_for(study_id, attempt)` (the intent to submit that job: it is
        recorded before the submission, so a submission whose answer was lost is found by
        it), and, with `charge`, the death of the previous job counted (`job_failures` or
        `weather_relaunches`). Attempt numbers only go up: one is never handed out twice.
        Run once; unfenced.

        Returns:
            (attempt, job id), or None when the study ended or (with `seen_attempts`)
            somebody launched it since the caller looked (nothing changed).
        """
        with session_scope(self.sessions) as s:
            claim = update(Study).where(Study.id == study_id, Study.status.in_(LIVE))
            if seen_attempts is not None:
                claim = claim.where(Study.job_attempts == seen_attempts)
            values: dict[str, Any] = {"job_attempts": Study.job_attempts + 1}
            if charge == Charge.FAILURE:
                values["job_failures"] = Study.job_failures + 1
            elif charge == Charge.WEATHER:
                values["weather_relaunches"] = Study.weather_relaunches + 1
            claimed = s.execute(claim.values(**values))
            if claimed.rowcount != 1:  # type: ignore[attr-defined]
                return None  # nothing changed: the transaction commits no update
            attempt = int(s.scalar(select(Study.job_attempts).where(Study.id == study_id)) or 0)
            job_id = job_id_for(study_id, attempt)
            s.execute(update(Study).where(Study.id == study_id).values(ray_job_id=job_id))
            return attempt, job_id

    def forget_unsubmitted(self, study_id: int, attempt: int, job_id: str) -> bool:
        """Clear the recorded job id of `attempt` after Ray said it has no such job (the
        submission failed and Ray never took it), so that the relaunch is not charged as a
        dead runner. The attempt number stays spent (never handed out again): a submission
        that reaches Ray after all runs as a superseded attempt once the next one is
        claimed. Changes nothing unless `attempt` is still current with `job_id` recorded.
        Run once; unfenced.

        Returns:
            Whether the row changed.
        """
        with session_scope(self.sessions) as s:
            changed = s.execute(
                update(Study)
                .where(
                    Study.id == study_id,
                    Study.job_attempts == attempt,
                    Study.ray_job_id == job_id,
                )
                .values(ray_job_id=None)
            ).rowcount  # type: ignore[attr-defined]
        return bool(changed)

    def live(self) -> Sequence[Row[int, str, str | None, datetime, int, int, int]]:
        """(id, status, ray_job_id, created_at, job_attempts, job_failures,
        weather_relaunches) of every live study. Run once; writes nothing."""
        with session_scope(self.sessions) as s:
            return s.execute(
                select(
                    Study.id,
                    Study.status,
                    Study.ray_job_id,
                    Study.created_at,
                    Study.job_attempts,
                    Study.job_failures,
                    Study.weather_relaunches,
                ).where(Study.status.in_(LIVE))
            ).all()

    def ended_with_open_trials(self) -> list[tuple[int, str, str | None]]:
        """(id, status, error) of FAILED or CANCELLED studies that still have QUEUED or
        RUNNING trials, in our table or in Optuna's: a runner that failed because the
        database did, a cancel cut off half way, or a close whose Optuna step failed after
        our rows were closed (found by Optuna's RUNNING trials, so the next round retries
        it). The reconciler closes their trials. Run once; writes nothing."""
        with session_scope(self.sessions) as s:
            open_rows = (
                select(Trial.id)
                .where(Trial.study_id == Study.id, Trial.state.in_(OPEN_TRIAL_STATES))
                .exists()
            )
            where = [open_rows]
            if _has_optuna_tables(s):
                where.append(_optuna_running.exists())
            rows = s.execute(
                select(Study.id, Study.status, Study.error)
                .where(Study.status.in_((StudyStatus.FAILED, StudyStatus.CANCELLED)), or_(*where))
                .order_by(Study.id)
            ).all()
        return [(int(i), str(st), err) for i, st, err in rows]

    # ---- why a study waits ------------------------------------------------------------

    def mark_ray_unreachable(self, address: str, error: object, study_id: int | None = None) -> int:
        """Say on live studies (or just `study_id`) that Ray's job server does not answer,
        instead of a silent PENDING; a reason the runner wrote is kept. Changes only their
        `waiting_reason`. Run once; unfenced.

        Returns:
            How many study rows changed.
        """
        reason = (
            f"{RAY_UNREACHABLE}: the job server at {address} does not answer "
            f"({_first_line(error)}); the study starts once it does"
        )
        q = update(Study).where(
            Study.status.in_(LIVE),
            or_(Study.waiting_reason.is_(None), Study.waiting_reason.startswith(RAY_UNREACHABLE)),
        )
        if study_id is not None:
            q = q.where(Study.id == study_id)
        with session_scope(self.sessions) as s:
            n = s.execute(q.values(waiting_reason=reason)).rowcount  # type: ignore[attr-defined]
        return int(n or 0)

    def mark_ray_reachable(self, study_id: int | None = None) -> None:
        """Clear the reasons `mark_ray_unreachable` wrote (on every study, or just
        `study_id`); the runner's own reasons stay. Run once; unfenced."""
        q = update(Study).where(Study.waiting_reason.startswith(RAY_UNREACHABLE))
        if study_id is not None:
            q = q.where(Study.id == study_id)
        with session_scope(self.sessions) as s:
            s.execute(q.values(waiting_reason=None))

    def set_waiting_reason(self, study_id: int, reason: str | None, queued: list[int]) -> None:
        """The runner's reason why the study's queued trials (row ids) do not start: on the
        study row and on those of `queued` that are still QUEUED. Retried; fenced.

        Raises:
            Superseded: The fence is stale; nothing changed.
            DatabaseUnavailable: The database stayed away for the outage window.
        """

        def write(s: Session) -> None:
            s.execute(update(Study).where(Study.id == study_id).values(waiting_reason=reason))
            s.execute(
                update(Trial)
                .where(Trial.id.in_(queued), Trial.state == TrialState.QUEUED)
                .values(waiting_reason=reason)
            )

        self._tx(write, "waiting reason")
