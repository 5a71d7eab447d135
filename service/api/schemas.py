"""Response bodies of the REST API."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Generic, TypeVar

from pydantic import AfterValidator, BaseModel, Field, PlainSerializer

from service.store import Study, Trial, jsonable

__all__ = ["ErrorBody", "FieldError", "MetricOut", "Page", "StudyOut", "TrialOut"]


def _utc(d: datetime) -> datetime:
    return d if d.tzinfo else d.replace(tzinfo=UTC)


# SQLite hands back naive datetimes; every stored time is UTC, so say so in the JSON.
UtcDatetime = Annotated[datetime, AfterValidator(_utc)]

# In JSON an infinity is the string "inf" ("-inf") and NaN is null (service/store/nonfinite.py):
# a float column, or a summary number such as `max_attn_logit_ever` after an overflow
# (docs/metrics.md section 9). Plain JSON has no infinity; unmarked, it would be null.
JsonFloat = Annotated[float, PlainSerializer(jsonable, return_type=float | str, when_used="json")]
JsonDict = Annotated[
    dict[str, Any], PlainSerializer(jsonable, return_type=dict[str, Any], when_used="json")
]


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
    job_attempts: int = Field(
        description="The runner-job attempt last launched (only ever goes up; the runner's fence)."
    )
    job_failures: int = Field(
        0,
        description="Runner jobs that died of the study or the cluster"
        " (bounded by QKSCOPE_MAX_JOB_ATTEMPTS).",
    )
    weather_relaunches: int = Field(
        0,
        description="Relaunches after a runner exited because the database was away: never"
        " charged to QKSCOPE_MAX_JOB_ATTEMPTS (bounded by QKSCOPE_MAX_WEATHER_RELAUNCHES).",
    )
    optuna_study_name: str
    error: str | None
    waiting_reason: str | None = Field(
        None, description="Why the study's trials are not starting (e.g. no node has a GPU)."
    )
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
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
    value: JsonFloat | None
    values: list[JsonFloat | None] | None
    feasible: bool | None
    last_step: int
    penalty_version: int = Field(
        description="Which eigenspectrum-penalty definition trained the trial: 1 (v1) or 2 (v2);"
        " see docs/metrics.md section 4"
    )
    final_val_loss: JsonFloat | None
    min_norm_entropy: JsonFloat | None
    final_rank_ratio: JsonFloat | None
    qk_eig_var: JsonFloat | None
    plateau_steps: int | None
    entropy_collapse: bool | None
    rank_collapse: bool | None
    trapped: bool | None
    error: str | None
    stop_reason: str | None = Field(
        None,
        description="Why a PRUNED trial stopped: a constraint it could no longer meet (e.g."
        " 'min_norm_entropy_ever 0.0048 < 0.1 at step 50') or the pruner's verdict.",
    )
    waiting_reason: str | None = Field(None, description="Why a QUEUED trial is not starting.")
    started_at: UtcDatetime | None = Field(
        description="When the trial's Ray task really started; null while QUEUED."
    )
    finished_at: UtcDatetime | None
    duration_s: JsonFloat | None
    summary: JsonDict | None = Field(
        None,
        description="What the trial ended with (docs/metrics.md), on /v1/trials/{id} and /best;"
        " an infinite number (e.g. `max_attn_logit_ever` after an overflow) is the string"
        ' "inf" here and in every float of this body;'
        " without the per-evaluation lists `eval_steps` and `val_losses` (the `val_loss`"
        " metric series: /v1/trials/{id}/metrics?name=val_loss) and with at most the last 100"
        " `plateaus` (`plateaus_left_out` counts the others).",
    )

    @classmethod
    def of(cls, row: Trial, with_summary: bool = False) -> TrialOut:
        """The trial as the API shows it; its summary only `with_summary` (then as the row
        holds it: the read routes load it bounded, service/read/summaries.py). Without it
        the row's summary is never read, so a row loaded with the column deferred stays so."""
        data = {name: getattr(row, name) for name in cls.model_fields if name != "summary"}
        if with_summary:
            data["summary"] = row.summary
        return cls.model_validate(data)


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
