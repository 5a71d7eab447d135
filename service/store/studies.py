"""Study rows: created PENDING, launched, RUNNING, and ended (COMPLETED, FAILED, CANCELLED).

Every write is one transaction and conditional on the state it changes: a terminal status
is never left (an update only matches a live row), a launch is claimed only if nobody
launched the study since the caller looked, and a job id is recorded before the job is
submitted (so a submission whose answer was lost is never submitted a second time).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
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
from sqlalchemy.orm import Session, sessionmaker

from service.spec import StudySpec
from service.store.fence import Fence, check_fence
from service.store.models import (
    OPEN_TRIAL_STATES,
    Study,
    StudyStatus,
    Trial,
    TrialState,
    utcnow,
)
from service.store.optuna import optuna_study_name
from service.store.session import session_scope, with_retry

__all__ = ["LIVE", "RAY_UNREACHABLE", "TERMINAL", "StudyRows"]

LIVE = (StudyStatus.PENDING, StudyStatus.RUNNING)
TERMINAL = (StudyStatus.COMPLETED, StudyStatus.FAILED, StudyStatus.CANCELLED)
# Starts every waiting_reason written while Ray's job server does not answer, so that the
# reason is cleared once it answers again without touching the runner's own reasons.
RAY_UNREACHABLE = "Ray cluster unreachable"


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


class StudyRows:
    """The writes of `qk_study` (and the reads its writers need). With a `fence` (a study
    runner's), the writes a runner makes (`set_status`, `fail_live`, `set_waiting_reason`,
    `check_current`) hold only while its attempt is current (service/store/fence.py)."""

    def __init__(self, sessions: sessionmaker[Session], fence: Fence | None = None) -> None:
        self.sessions = sessions
        self.fence = fence

    # ---- creation ------------------------------------------------------------------------

    def create(self, spec: StudySpec, idempotency_key: str | None = None) -> tuple[Study, bool]:
        """Insert a PENDING study, or return the one an earlier request with the same
        idempotency key created (two concurrent POSTs race on the unique index: the loser
        reads the winner's row)."""
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
            row = Study(
                name=spec.name,
                status=StudyStatus.PENDING,
                spec=spec.model_dump(mode="json", by_alias=True),
                n_trials=spec.budget.n_trials,
                optuna_study_name="",
                idempotency_key=idempotency_key,
            )
            s.add(row)
            s.flush()
            row.optuna_study_name = optuna_study_name(row.id)
            return row, True

    def get(self, study_id: int) -> Study | None:
        with session_scope(self.sessions) as s:
            return s.get(Study, study_id)

    # ---- status --------------------------------------------------------------------------

    def set_status(self, study_id: int, status: StudyStatus, error: str | None = None) -> bool:
        """Move a live study to `status`; a terminal status (a cancel) is never left. Returns
        whether the row changed."""
        values: dict[str, Any] = {"status": status}
        if status in TERMINAL:
            values["finished_at"] = utcnow()
        if error:
            values["error"] = error

        def write() -> bool:
            with session_scope(self.sessions) as s:
                check_fence(s, self.fence)
                q = update(Study).where(Study.id == study_id, Study.status.in_(LIVE))
                changed = s.execute(q.values(**values)).rowcount  # type: ignore[attr-defined]
                if status == StudyStatus.RUNNING:
                    s.execute(
                        update(Study)
                        .where(Study.id == study_id, Study.started_at.is_(None))
                        .values(started_at=utcnow())
                    )
                return bool(changed)

        return with_retry(write, "set study status")

    def check_current(self) -> None:
        """Raise `Superseded` unless this store's fence is the study's current attempt
        (before a write elsewhere: an Optuna ask)."""

        def check() -> None:
            with session_scope(self.sessions) as s:
                check_fence(s, self.fence)

        if self.fence is not None:
            with_retry(check, "check fence")

    def status(self, study_id: int) -> StudyStatus | None:
        def read() -> StudyStatus | None:
            with session_scope(self.sessions) as s:
                v = s.scalar(select(Study.status).where(Study.id == study_id))
                return None if v is None else StudyStatus(v)

        return with_retry(read, "read study status")

    def cancel(self, study_id: int) -> tuple[Study | None, str | None]:
        """Mark a live study CANCELLED; returns the row and the Ray job id to stop (None when
        the study had ended already: a cancel of an ended study changes nothing)."""
        with session_scope(self.sessions) as s:
            changed = s.execute(
                update(Study)
                .where(Study.id == study_id, Study.status.in_(LIVE))
                .values(status=StudyStatus.CANCELLED, finished_at=utcnow(), waiting_reason=None)
            ).rowcount  # type: ignore[attr-defined]
            row = s.get(Study, study_id)
            return row, (row.ray_job_id if row is not None and changed else None)

    def fail_live(self, study_id: int, reason: str) -> bool:
        """FAILED with `reason`, unless the study ended meanwhile."""
        return self.set_status(study_id, StudyStatus.FAILED, reason)

    # ---- launching -----------------------------------------------------------------------

    def claim_launch(self, study_id: int, seen_attempts: int | None) -> int | None:
        """Claim the next runner-job attempt of a live study: its number, or None when the
        study ended or (with `seen_attempts`) somebody launched it since the caller looked."""
        with session_scope(self.sessions) as s:
            claim = update(Study).where(Study.id == study_id, Study.status.in_(LIVE))
            if seen_attempts is not None:
                claim = claim.where(Study.job_attempts == seen_attempts)
            claimed = s.execute(claim.values(job_attempts=Study.job_attempts + 1))
            if claimed.rowcount != 1:  # type: ignore[attr-defined]
                return None
            return int(s.scalar(select(Study.job_attempts).where(Study.id == study_id)) or 0)

    def record_job(self, study_id: int, job_id: str | None) -> None:
        """The job id of the attempt about to be submitted (chosen by us, recorded first)."""
        with session_scope(self.sessions) as s:
            s.execute(update(Study).where(Study.id == study_id).values(ray_job_id=job_id))

    def unclaim_launch(self, study_id: int, previous_job: str | None) -> None:
        """The job was certainly not submitted: the attempt does not count."""
        with session_scope(self.sessions) as s:
            s.execute(
                update(Study)
                .where(Study.id == study_id)
                .values(job_attempts=Study.job_attempts - 1, ray_job_id=previous_job)
            )

    def live(self) -> Sequence[Row[int, str, str | None, datetime, int]]:
        """(id, status, ray_job_id, created_at, job_attempts) of every live study."""
        with session_scope(self.sessions) as s:
            return s.execute(
                select(
                    Study.id, Study.status, Study.ray_job_id, Study.created_at, Study.job_attempts
                ).where(Study.status.in_(LIVE))
            ).all()

    def ended_with_open_trials(self) -> list[tuple[int, str, str | None]]:
        """(id, status, error) of FAILED or CANCELLED studies that still have QUEUED or
        RUNNING trials, in our table or in Optuna's: a runner that failed because the
        database did, a cancel cut off half way, or a close whose Optuna step failed after
        our rows were closed (found by Optuna's RUNNING trials, so the next round retries
        it). The reconciler closes their trials."""
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
        instead of a silent PENDING; a reason the runner wrote is kept. Returns how many."""
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
        q = update(Study).where(Study.waiting_reason.startswith(RAY_UNREACHABLE))
        if study_id is not None:
            q = q.where(Study.id == study_id)
        with session_scope(self.sessions) as s:
            s.execute(q.values(waiting_reason=None))

    def set_waiting_reason(self, study_id: int, reason: str | None, queued: list[int]) -> None:
        """The runner's reason why the study's queued trials (row ids) do not start."""

        def write() -> None:
            with session_scope(self.sessions) as s:
                check_fence(s, self.fence)
                s.execute(update(Study).where(Study.id == study_id).values(waiting_reason=reason))
                s.execute(
                    update(Trial)
                    .where(Trial.id.in_(queued), Trial.state == TrialState.QUEUED)
                    .values(waiting_reason=reason)
                )

        with_retry(write, "waiting reason")
