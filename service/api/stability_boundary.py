"""/v1/studies/{id}/stability-boundary: the learning rate each width can take, and its
power-law fit across widths (METRICS.md section 11; Wortsman et al. 2024); the numbers come
from service.read.stability_boundary."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from service.api.deps import SessionDep, StudyDep
from service.api.schemas import ErrorBody
from service.read.stability_boundary import study_stability_boundary

__all__ = ["StabilityBoundaryOut", "router"]

router = APIRouter(prefix="/v1", tags=["studies"])


class PointOut(BaseModel):
    width: float
    seed: int
    n_lrs: int = Field(description="learning rates with a result at this width and seed")
    l0: float | None = Field(description="validation loss of the untrained model (step 0)")
    l_star: float | None = Field(description="the best final validation loss")
    eta_star: float | None = Field(description="the learning rate of l_star")
    eta_opt: float | None = Field(description="eta_star refined by a parabola in log eta")
    eta_max: float | None = Field(description="sqrt(eta_s eta_u); None: undefined (reason)")
    eta_s: float | None = Field(description="the largest stable learning rate below eta_u")
    eta_u: float | None = Field(description="the first unstable learning rate above eta_star")
    ratio: float | None = Field(description="eta_u / eta_s, the final bracket")
    bisection_steps: int = Field(description="learning rates tried off the study's grid")
    unstable: list[float]
    reason: str | None = Field(description="why eta_max is undefined")
    unfinished: int = Field(description="trials of this width and seed without a result")


class SeedFitOut(BaseModel):
    seed: int
    widths: list[float]
    a: float
    b: float
    prediction: float


class BandPointOut(BaseModel):
    width: float
    eta: float
    low: float | None
    high: float | None


class FitOut(BaseModel):
    target_width: float
    n_seeds: int
    b: float | None = Field(description="the exponent, mean over seeds")
    b_low: float | None
    b_high: float | None
    prediction: float | None = Field(description="at target_width, geometric mean over seeds")
    prediction_low: float | None
    prediction_high: float | None
    seeds: list[SeedFitOut]
    left_out: list[dict[str, Any]]
    reason: str | None
    band: list[BandPointOut] = Field(
        description="the fit from the smallest width to target_width with its t interval"
    )


class SeedHoldoutOut(BaseModel):
    seed: int
    predicted: float
    measured: float
    ratio: float


class HoldoutOut(BaseModel):
    width: float = Field(description="the largest width, left out of the refit")
    n_seeds: int
    ratio: float | None = Field(description="predicted / measured eta_max, geometric mean")
    ratio_low: float | None
    ratio_high: float | None
    seeds: list[SeedHoldoutOut]
    left_out: list[dict[str, Any]]
    reason: str | None


class GroupOut(BaseModel):
    params: dict[str, Any] = Field(description="the group_by parameters' values")
    widths: list[float]
    points: list[PointOut]
    eta_max_fit: FitOut
    eta_opt_fit: FitOut
    holdout: HoldoutOut | None = Field(description="None below three widths")
    repeated: int


class StabilityBoundaryOut(BaseModel):
    study_id: int
    width: str = Field(description="the parameter that is the width")
    group_by: list[str]
    target_width: float
    tau: float
    instability_constraints: list[str]
    confidence: float
    groups: list[GroupOut]


@router.get(
    "/studies/{study_id}/stability-boundary",
    response_model=StabilityBoundaryOut,
    responses={
        404: {"model": ErrorBody, "description": "no such study"},
        422: {
            "model": ErrorBody,
            "description": "no learning-rate axis, no width axis or only one width, a "
            "group_by that is not one of the study's parameters (or leaves one out), no "
            "step-0 evaluation, or a bad tau / target_width; named in errors[].field",
        },
    },
)
def get_stability_boundary(
    session: SessionDep,
    study: StudyDep,
    width: Annotated[str | None, Query(max_length=200)] = None,
    group_by: Annotated[list[str] | None, Query(max_length=64)] = None,
    target_width: Annotated[float | None, Query(gt=0, le=1e9)] = None,
    tau: Annotated[float | None, Query(gt=0, le=1)] = None,
) -> StabilityBoundaryOut:
    """The stability boundary (METRICS.md section 11) of each group of trials that differ
    only in `optim.lr`, width and seed: per width and seed `eta_max` (the largest stable
    learning rate, as the geometric mean of the last stable and first unstable one above
    the best) and `eta_opt`; the fit `log eta = a + b log w` per seed, then `b` and the
    prediction at `target_width` (default the largest width) over seeds with a 95 % t
    interval; and with 3+ widths the held-out check (refit without the largest width,
    predicted / measured eta_max there). `width` names the width parameter (default
    `model.d_model` or `model.hf.config.hidden_size`); `tau` the loss rule (default the
    study's, else 0.5)."""
    result = study_stability_boundary(session, study, width, group_by, target_width, tau)
    return StabilityBoundaryOut.model_validate(dataclasses.asdict(result))
