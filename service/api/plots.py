"""/v1/studies/{id}/plots/{kind}: a study's results as a PNG, or the plot's data as JSON."""

from __future__ import annotations

import enum
import threading
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from service.api.deps import MAX_ID, SessionDep, StudyDep
from service.api.schemas import ErrorBody
from service.read.plots import PLOT_KINDS, PlotOptions, plot_data, render_png

__all__ = ["PlotKind", "router"]

router = APIRouter(prefix="/v1", tags=["plots"])

Field = Annotated[str | None, Query(max_length=200)]
Pixels = Annotated[int, Query(ge=200, le=4000)]
# Rendering is CPU-bound: a few at a time, the rest of the threadpool stays free for queries.
_RENDER_SLOTS = threading.BoundedSemaphore(4)


class PlotKind(enum.StrEnum):
    metric = "metric"
    scatter = "scatter"
    phase = "phase"
    pareto = "pareto"
    history = "history"
    importance = "importance"


assert tuple(PlotKind) == PLOT_KINDS

PNG_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "a PNG (default) or, with format=json, the plot's data",
        "content": {"image/png": {}, "application/json": {}},
    },
    404: {"model": ErrorBody, "description": "no such study"},
    422: {
        "model": ErrorBody,
        "description": "a bad plot kind or parameter, named in errors[].field",
    },
}


def wants_json(fmt: str | None, accept: str | None) -> bool:
    """`format=` decides; without it, an Accept header asking for JSON and not PNG does."""
    if fmt is not None:
        return fmt == "json"
    accept = (accept or "").lower()
    return "application/json" in accept and "image/png" not in accept


@router.get(
    "/studies/{study_id}/plots/{kind}",
    response_class=Response,
    responses=PNG_DOC,
)
def get_plot(
    request: Request,
    session: SessionDep,
    study: StudyDep,
    kind: PlotKind,
    metric: Annotated[str | None, Query(max_length=64)] = None,
    trials: Annotated[str | None, Query(max_length=400)] = None,
    layer: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    head: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    x: Field = None,
    y: Field = None,
    color: Field = None,
    objective: Annotated[int, Query(ge=0, le=16)] = 0,
    target: Annotated[str | None, Query(max_length=64)] = None,
    evaluator: Literal["fanova", "ped_anova"] = "fanova",
    feasible_only: bool = True,
    format: Literal["png", "json"] | None = None,
    width: Pixels = 900,
    height: Pixels = 600,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Response:
    """Kinds: `metric` (`metric=`, `trials=3,7`, `layer=`, `head=`), `scatter` (`x=params.<path>`,
    `y=<summary metric>`, `color=`), `phase` (collapse classes over `x`, `y`), `pareto`
    (`x`/`y` name objectives), `history` (`objective=`), `importance` (`target=`,
    `evaluator=`). `format=json` (or `Accept: application/json`) returns the data instead of
    the PNG."""
    options = PlotOptions(
        metric=metric,
        trials=trials,
        layer=layer,
        head=head,
        x=x,
        y=y,
        color=color,
        objective=objective,
        feasible_only=feasible_only,
        target=target,
        evaluator=evaluator,
        importance_cache=request.app.state.importance,  # shared with /importance
    )
    data = plot_data(session, study, str(kind), options)  # PlotError: a 422 (api/errors.py)
    session.close()  # give the connection back before the CPU-bound part
    if wants_json(format, accept):
        return JSONResponse(data)
    with _RENDER_SLOTS:
        png = render_png(data, width=width, height=height)
    return Response(
        png,
        media_type="image/png",
        headers={
            "Content-Disposition": f'inline; filename="study-{study.id}-{kind}.png"',
            "Cache-Control": "no-store",
        },
    )
