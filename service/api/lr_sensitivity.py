"""/v1/studies/{id}/lr-sensitivity: learning-rate sensitivity per group of trials (METRICS.md
section 9, Wortsman et al.'s Figure 1); the numbers come from service.read.lr_sensitivity."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from service.api.deps import SessionDep, SettingsDep, StudyDep
from service.api.schemas import ErrorBody
from service.read.lr_sensitivity import study_lr_sensitivity

__all__ = ["LrSensitivityOut", "router"]

router = APIRouter(prefix="/v1", tags=["studies"])


class CurvePointOut(BaseModel):
    lr: float
    n: int = Field(description="seeds with a final loss at this learning rate")
    diverged: int = Field(description="of them, how many diverged (counted as their l_0)")
    median: float | None
    q25: float | None
    q75: float | None
    min: float | None
    max: float | None
    above_l0: int = Field(
        description="of the n, seeds whose finite final loss lies above their l_0 (clipped)"
    )
    clipped_median: float | None = Field(
        description="median over seeds of min(l, l_0): what the sensitivity uses"
    )
    clipped_min: float | None
    clipped_max: float | None


class SeedOut(BaseModel):
    seed: int
    l0: float = Field(description="validation loss of the untrained model (step 0)")
    l_star: float = Field(description="min over the grid of l(eta)")
    sensitivity: float
    losses: list[float] = Field(description="l(eta) at each grid eta; diverged as l0")


class LeftOutOut(BaseModel):
    seed: int
    reason: str
    missing_lrs: list[float]


class GroupOut(BaseModel):
    params: dict[str, Any] = Field(description="the group_by parameters' values")
    n_seeds: int = Field(description="seeds in the sensitivity: those with every grid point")
    sensitivity: float | None = Field(description="mean over those seeds")
    ci_low: float | None = Field(description="Student-t interval of the mean (2+ seeds)")
    ci_high: float | None
    l0: float | None = Field(description="mean over seeds of the step-0 validation loss")
    curve: list[CurvePointOut]
    seeds: list[SeedOut]
    left_out: list[LeftOutOut] = Field(description="seeds left out, each with why")
    repeated: int = Field(description="finished trials beyond the first of a (seed, eta)")
    l_star: float | None = Field(description="mean over the sensitivity's seeds of their l*")
    unigram_floor: float | None = Field(
        description="cross-entropy of the training split's token frequencies on the "
        "evaluation targets (METRICS.md 9); None where the task has no corpus"
    )
    note: str | None = Field(
        description="set when l* is not below the unigram floor (the group says nothing "
        "about attention), or why there is no floor"
    )


class LrSensitivityOut(BaseModel):
    study_id: int
    group_by: list[str]
    grid: list[float] = Field(description="the learning rates of optim.lr's grid, ascending")
    log_spaced: bool = Field(description="the grid is (about) equally spaced in log eta")
    confidence: float
    groups: list[GroupOut]


@router.get(
    "/studies/{study_id}/lr-sensitivity",
    response_model=LrSensitivityOut,
    responses={
        404: {"model": ErrorBody, "description": "no such study"},
        422: {
            "model": ErrorBody,
            "description": "optim.lr not searched on a grid, a group_by that is not one of the "
            "study's parameters (or leaves one out), or no step-0 evaluation; named in "
            "errors[].field",
        },
    },
)
def get_lr_sensitivity(
    session: SessionDep,
    study: StudyDep,
    settings: SettingsDep,
    group_by: Annotated[list[str] | None, Query(max_length=64)] = None,
) -> LrSensitivityOut:
    """Learning-rate sensitivity (METRICS.md section 9) of each group of trials that differ
    only in `optim.lr` and seed: per seed `mean over eta of [min(l(eta), l_0) - l*]`, then
    the mean over seeds with a 95 % Student-t interval, beside the curve `l(eta)` (median,
    quartiles and range over seeds) and `l_0`. `group_by` (repeatable) names the parameters
    that make the groups; default every searched parameter but optim.lr and seed. A seed
    missing a grid point is left out of the sensitivity and listed with why (`left_out`).
    Each group's `l*` stands beside the unigram floor of its data, with a `note` when it is
    not below it: such a group has not learned what attention is for (METRICS.md 9)."""
    result = study_lr_sensitivity(session, study, group_by, settings.data_dir)  # 422s
    return LrSensitivityOut.model_validate(dataclasses.asdict(result))
