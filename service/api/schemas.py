"""Response bodies of the REST API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from service.db.models import Study, Trial

__all__ = ["ErrorBody", "FieldError", "MetricOut", "Page", "StudyOut", "TrialOut"]


class FieldError(BaseModel):
    field: str
    message: str


class ErrorBody(BaseModel):
    error: str
    message: str
    errors: list[FieldError] = []


class StudyOut(BaseModel):
    id: int
    name: str
    status: str
    n_trials: int
    ray_job_id: str | None
    job_attempts: int
    optuna_study_name: str
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any]

    @classmethod
    def of(cls, row: Study) -> StudyOut:
        return cls.model_validate(row, from_attributes=True)


class TrialOut(BaseModel):
    id: int
    study_id: int
    number: int
    state: str
    params: dict[str, Any]
    seed: int
    attempts: int
    node: str | None
    value: float | None
    values: list[float | None] | None
    feasible: bool | None
    last_step: int
    final_val_loss: float | None
    min_norm_entropy: float | None
    final_rank_ratio: float | None
    qk_eig_var: float | None
    plateau_steps: int | None
    entropy_collapse: bool | None
    rank_collapse: bool | None
    trapped: bool | None
    error: str | None
    started_at: datetime
    finished_at: datetime | None
    duration_s: float | None
    summary: dict[str, Any] | None = None

    @classmethod
    def of(cls, row: Trial, with_summary: bool = False) -> TrialOut:
        out = cls.model_validate(row, from_attributes=True)
        return out if with_summary else out.model_copy(update={"summary": None})


class MetricOut(BaseModel):
    name: str
    layer: int | None
    head: int | None
    step: int
    value: float | None


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int
