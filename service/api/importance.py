"""/v1/studies/{id}/importance: which search-space parameters drive an objective or any stored
summary metric (fANOVA by default, PED-ANOVA selectable); see service.read.importance."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from service.api.deps import SessionDep, StudyDep
from service.api.errors import ApiError, field_errors
from service.api.schemas import ErrorBody
from service.read.importance import ImportanceCache, TooFewTrials

__all__ = ["ImportanceOut", "router"]

router = APIRouter(prefix="/v1", tags=["studies"])


class ImportanceOut(BaseModel):
    study_id: int
    target: str
    evaluator: str
    direction: str
    n_trials: int
    importances: dict[str, float]  # parameter -> importance, largest first


@router.get(
    "/studies/{study_id}/importance",
    response_model=ImportanceOut,
    responses={
        404: {"model": ErrorBody, "description": "no such study"},
        409: {
            "model": ErrorBody,
            "description": "too_few_trials: the message says how many COMPLETE trials it needs",
        },
        422: {"model": ErrorBody, "description": "an unknown target, named in errors[].field"},
    },
)
def get_importance(
    request: Request,
    session: SessionDep,
    study: StudyDep,
    target: Annotated[str | None, Query(max_length=64)] = None,
    evaluator: Literal["fanova", "ped_anova"] = "fanova",
    direction: Literal["minimize", "maximize"] | None = None,
) -> ImportanceOut:
    """Rank the search-space parameters by importance for `target`: `value`, an objective's
    metric, or any summary metric (`final_val_loss`, `min_norm_entropy`, `final_rank_ratio`,
    `qk_eig_var`, ...); default the first objective. Uses the study's COMPLETE trials, so it
    works while the study runs. `direction` (PED-ANOVA only: which end is "good") defaults to
    the objective's, else minimize. A ranking is cached until another trial of the study
    completes."""
    try:
        cache: ImportanceCache = request.app.state.importance
        result = cache.get(session, study, target, evaluator, direction)
    except TooFewTrials as e:  # not yet, rather than never: a 409 (any other error is a 422)
        raise ApiError(409, "too_few_trials", e.message, field_errors([e])) from None
    return ImportanceOut(**result.as_json(study.id))
