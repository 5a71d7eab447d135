"""Standby rows: a study id reserved, with a runner job already started for it.

A study's first result waits for its runner job: a Ray job, a driver, a worker process and
torch's import, about 5 to 8 s on a small machine before its first training step. A
*standby* is that job started ahead of time for an id nobody has asked for yet: a `qk_study`
row in the private status `STANDBY`, whose runner waits, warm, until a POST claims the row
(`claim`, called by `StudyRows.create`) and then runs that study as if it had been launched
for it. The Ray job is the one a cold launch would submit (`qkscope-study-<id>-a1-...`),
so the dashboard's Jobs page and every guarantee of a launched study (its own job, fenced
writes, the reconciler's relaunch) stay as they are.

A standby row is not a study: it has no definition, the API does not show it, and it is
never LIVE. Its `started_at` is its runner's heartbeat while it waits (the runner is warm and
watching); a POST claims only a standby whose heartbeat is fresh, so a dead standby is never
handed a study. Claiming moves the row to PENDING with the POSTed definition and clears
`started_at`; from there on it is an ordinary study.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from service.store.models import Study, StudyStatus, utcnow
from service.store.optuna import optuna_study_name
from service.store.rows import Rows
from service.store.session import session_scope

__all__ = ["STANDBY", "HEARTBEAT_S", "StandbyRow", "StandbyRows", "Waiting", "claim"]

STANDBY = "STANDBY"  # the private status of a reserved row; never a StudyStatus
HEARTBEAT_S = 2.0  # how often a waiting standby runner says it is alive
STALE_S = 3 * HEARTBEAT_S  # a heartbeat older than this: the standby is not claimed


class Waiting(StrEnum):
    """What a standby runner finds when it looks at its row."""

    WAITING = "WAITING"  # still a standby: keep waiting
    CLAIMED = "CLAIMED"  # a POST made it a study: run it
    GONE = "GONE"  # retired (row deleted): exit


StandbyRow = tuple[int, str | None, datetime, datetime | None]  # id, job, created, heartbeat


def claim(s: Session, values: dict[str, Any]) -> Study | None:
    """Inside a POST's transaction: turn the oldest standby with a fresh heartbeat into the
    study `values` describes (PENDING), or None when there is none. Two POSTs never claim
    the same row: the update matches only a row still in STANDBY."""
    fresh = utcnow() - timedelta(seconds=STALE_S)
    candidates = s.scalars(
        select(Study.id)
        .where(Study.status == STANDBY, Study.ray_job_id.is_not(None), Study.started_at >= fresh)
        .order_by(Study.id)
        .limit(4)
    ).all()
    for study_id in candidates:
        took = s.execute(
            update(Study)
            .where(Study.id == study_id, Study.status == STANDBY)
            .values(**values, status=StudyStatus.PENDING, created_at=utcnow(), started_at=None)
        )
        if took.rowcount == 1:  # type: ignore[attr-defined]
            return s.get(Study, study_id, populate_existing=True)
    return None


class StandbyRows(Rows):
    """The writes of standby rows. Each method is one transaction, run once and unfenced,
    except the runner's `look` (retried, as the runner's other reads)."""

    def add(self, job_id_for: Callable[[int, int], str]) -> tuple[int, str]:
        """Reserve an id: a STANDBY row whose attempt 1 is claimed and whose job id
        (`job_id_for(id, 1)`) is recorded, before the caller submits that job.

        Returns:
            The reserved id and the job id to submit.
        """
        with session_scope(self.sessions) as s:
            row = Study(
                name="(standby)",
                status=STANDBY,
                spec={},
                n_trials=0,
                optuna_study_name="",
                job_attempts=1,
            )
            s.add(row)
            s.flush()
            row.optuna_study_name = optuna_study_name(row.id)
            row.ray_job_id = job_id_for(row.id, 1)
            return row.id, row.ray_job_id

    def listed(self) -> list[StandbyRow]:
        """(id, job id, created_at, heartbeat) of every standby row, oldest first. Writes
        nothing."""
        with session_scope(self.sessions) as s:
            rows = s.execute(
                select(Study.id, Study.ray_job_id, Study.created_at, Study.started_at)
                .where(Study.status == STANDBY)
                .order_by(Study.id)
            ).all()
        return [(int(i), j, c, h) for i, j, c, h in rows]

    def drop(self, study_id: int) -> bool:
        """Delete a standby row (its job is dead, or it is retired); a row that a POST
        claimed meanwhile is a study and stays. Changes only that row.

        Returns:
            Whether the row was deleted.
        """
        with session_scope(self.sessions) as s:
            q = delete(Study).where(Study.id == study_id, Study.status == STANDBY)
            return bool(s.execute(q).rowcount)  # type: ignore[attr-defined]

    def look(self, study_id: int, heartbeat: bool) -> Waiting:
        """The standby runner's look at its row; with `heartbeat`, it also records that
        the runner is alive and warm (`started_at`, only while the row is a standby).
        Retried (`DatabaseUnavailable` after the outage window); changes only that row.

        Returns:
            WAITING, CLAIMED (a POST made it a study) or GONE (the row was retired).
        """

        def work(s: Session) -> Waiting:
            if heartbeat:
                s.execute(
                    update(Study)
                    .where(Study.id == study_id, Study.status == STANDBY)
                    .values(started_at=utcnow())
                )
            status = s.scalar(select(Study.status).where(Study.id == study_id))
            if status is None:
                return Waiting.GONE
            return Waiting.WAITING if status == STANDBY else Waiting.CLAIMED

        return self._tx(work, "standby heartbeat", fenced=False)
