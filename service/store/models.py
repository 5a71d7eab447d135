"""SQLAlchemy 2 typed models: studies, trials and per-step metrics.

Tables carry the `qk_` prefix so they never collide with the tables Optuna's
RDBStorage keeps in the same database.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    ScalarSelect,
    String,
    Text,
    UniqueConstraint,
    func,
    select,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from service.store.nonfinite import SummaryJSON
from workers.metric_names import COLUMN_SUMMARIES

__all__ = [
    "CURRENT_PENALTY_VERSION",
    "OPEN_TRIAL_STATES",
    "Base",
    "Metric",
    "Study",
    "StudyStatus",
    "Trial",
    "TrialState",
    "stored_metric_rows",
    "utcnow",
]

# The eigenspectrum-penalty version new trials are trained with (docs/metrics.md section 4).
# It must equal workers.regularizers.PENALTY_VERSION (a test checks); it lives here too so the
# service can label trials without importing torch. Rows from before the column are 1.
CURRENT_PENALTY_VERSION = 2

NO_INDEX = -1  # layer/head value for metrics that have none (keeps the primary key total)
# Summary numbers the runner copies from a trial's summary into Trial columns, so the
# results API can filter and sort on them fast: the registry's `column` summaries (a test
# checks that the Trial class below has exactly these columns).
SUMMARY_COLUMNS: tuple[str, ...] = COLUMN_SUMMARIES


def utcnow() -> datetime:
    return datetime.now(UTC)


class StudyStatus(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class TrialState(enum.StrEnum):
    QUEUED = "QUEUED"  # launched, but Ray has not started its task yet
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"
    DIVERGED = "DIVERGED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


OPEN_TRIAL_STATES = (TrialState.QUEUED, TrialState.RUNNING)  # not finished yet


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Study(Base):
    __tablename__ = "qk_study"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=StudyStatus.PENDING, index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    n_trials: Mapped[int] = mapped_column(Integer)
    optuna_study_name: Mapped[str] = mapped_column(String(64))
    ray_job_id: Mapped[str | None] = mapped_column(String(128), default=None)
    # The runner-job attempt last claimed: the fence token (service/store/fence.py). Only
    # ever goes up: an attempt number is handed out once.
    job_attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Runner jobs that died of the study or the cluster (bounded by max_job_attempts), and
    # relaunches after weather (the database away; a submission Ray never took), bounded by
    # max_weather_relaunches: charged by the reconciler when it relaunches.
    job_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    weather_relaunches: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    idempotency_key: Mapped[str | None] = mapped_column(String(200), default=None, unique=True)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    # Why trials are not starting (e.g. no node can provide the resources); None when they do.
    waiting_reason: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class Trial(Base):
    __tablename__ = "qk_trial"
    __table_args__ = (
        UniqueConstraint("study_id", "number"),
        Index("ix_qk_trial_study_state", "study_id", "state"),
        Index("ix_qk_trial_study_value", "study_id", "value"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("qk_study.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=TrialState.QUEUED)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    node: Mapped[str | None] = mapped_column(String(200), default=None)
    value: Mapped[float | None] = mapped_column(Float, default=None)
    values: Mapped[list[Any] | None] = mapped_column(JSON, default=None)
    feasible: Mapped[bool | None] = mapped_column(Boolean, default=None)
    # infinities stored as "inf" (service/store/nonfinite.py)
    summary: Mapped[dict[str, Any] | None] = mapped_column(SummaryJSON, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    last_step: Mapped[int] = mapped_column(Integer, default=0)
    # Which definition of the eigenspectrum penalties trained this trial (1 or 2).
    penalty_version: Mapped[int] = mapped_column(Integer, default=CURRENT_PENALTY_VERSION)
    # Metric rows stored for this trial, counted when it finishes (Prometheus reads the sum).
    metric_rows: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Summary numbers copied into columns so the results API can filter and sort on them.
    final_val_loss: Mapped[float | None] = mapped_column(Float, default=None)
    min_norm_entropy: Mapped[float | None] = mapped_column(Float, default=None)
    final_rank_ratio: Mapped[float | None] = mapped_column(Float, default=None)
    qk_eig_var: Mapped[float | None] = mapped_column(Float, default=None)
    plateau_steps: Mapped[int | None] = mapped_column(Integer, default=None)
    entropy_collapse: Mapped[bool | None] = mapped_column(Boolean, default=None)
    rank_collapse: Mapped[bool | None] = mapped_column(Boolean, default=None)
    trapped: Mapped[bool | None] = mapped_column(Boolean, default=None)
    waiting_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # Why a PRUNED trial stopped (a constraint it could no longer meet, or the pruner).
    stop_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # The runner job attempt that last claimed it after a dead runner (attempts count once).
    claimed_by: Mapped[int | None] = mapped_column(Integer, default=None)
    # When the trial's Ray task really started (None while QUEUED); set by the task itself.
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    duration_s: Mapped[float | None] = mapped_column(Float, default=None)


class Metric(Base):
    """One number of one evaluation; the primary key makes a replayed report a no-op."""

    __tablename__ = "qk_metric"

    trial_id: Mapped[int] = mapped_column(
        ForeignKey("qk_trial.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    layer: Mapped[int] = mapped_column(Integer, primary_key=True, default=NO_INDEX)
    head: Mapped[int] = mapped_column(Integer, primary_key=True, default=NO_INDEX)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float | None] = mapped_column(Float, default=None)


def stored_metric_rows() -> ScalarSelect[int]:
    """The number of metric rows stored for the `Trial` row being updated (correlated).

    For `update(Trial)...values(metric_rows=stored_metric_rows())`: every path that finishes
    a trial in bulk (a cancel) counts its rows the same way the runner does one by one.
    """
    return select(func.count()).where(Metric.trial_id == Trial.id).scalar_subquery()
