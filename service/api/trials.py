"""/v1/trials: one trial, and its per-step metrics."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy import select

from service.api.deps import SessionDep, TrialDep
from service.api.errors import ApiError
from service.api.openapi import not_found
from service.api.paging import decode_cursor, encode_cursor
from service.api.schemas import FieldError, MetricOut, TrialOut
from service.read import queries
from service.read.summaries import trials_with_bounded_summaries
from service.store import Trial
from workers.metric_names import SERIES_NAMES

__all__ = ["MAX_METRIC_ROWS", "NEXT_CURSOR", "router"]

_METRIC_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")

router = APIRouter(prefix="/v1", tags=["trials"])

MAX_INT = 2**31 - 1  # PostgreSQL integer
Bounded = Query(ge=0, le=MAX_INT)


@router.get("/trials/{trial_id}", response_model=TrialOut, responses=not_found("trial"))
def get_trial(session: SessionDep, trial: TrialDep) -> TrialOut:
    """The trial with its summary, bounded: the per-evaluation `val_loss` is a metric series
    (`/v1/trials/{id}/metrics?name=val_loss`), not a list in the summary."""
    (row,) = trials_with_bounded_summaries(session, select(Trial).where(Trial.id == trial.id))
    return TrialOut.of(row, with_summary=True)


MAX_METRIC_ROWS = 100_000  # rows one /metrics call returns at most
NEXT_CURSOR = "X-Next-Cursor"


def _check_names(session: SessionDep, trial_id: int, names: list[str]) -> None:
    """422 naming `name` for a malformed name, or one neither registered nor stored for the
    trial (a name outside the registry is fine only if the trial stored it, as the plot
    route allows)."""
    bad = [n for n in names if not _METRIC_NAME.fullmatch(n)]
    if bad:
        raise ApiError(
            422,
            "validation_error",
            f"name: {bad[0]!r} is not a metric name",
            [FieldError(field="name", message="letters, digits and _ only")],
        )
    unknown = [n for n in names if n not in SERIES_NAMES]
    missing = set(unknown) - queries.stored_metric_names(session, trial_id, unknown)
    if missing:
        first = next(n for n in unknown if n in missing)
        raise ApiError(
            422,
            "validation_error",
            f"name: unknown metric {first!r}",
            [FieldError(field="name", message=f"one of {', '.join(SERIES_NAMES)}")],
        )


@router.get(
    "/trials/{trial_id}/metrics",
    response_model=list[MetricOut],
    responses={
        **not_found("trial"),
        200: {
            "description": (
                "a page of rows; when there are more, the X-Next-Cursor header (and a Link "
                'header, rel="next") gives the cursor of the next page'
            ),
            "headers": {
                NEXT_CURSOR: {
                    "description": "pass as cursor= for the next page; absent on the last",
                    "schema": {"type": "string"},
                }
            },
        },
    },
)
def get_metrics(
    request: Request,
    response: Response,
    session: SessionDep,
    trial: TrialDep,
    name: Annotated[list[str] | None, Query(max_length=50)] = None,
    layer: Annotated[int | None, Bounded] = None,
    head: Annotated[int | None, Bounded] = None,
    step_min: Annotated[int | None, Bounded] = None,
    step_max: Annotated[int | None, Bounded] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_METRIC_ROWS)] = 10_000,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> list[MetricOut]:
    """Metric rows ordered by (name, layer, head, step); layer/head null where not applicable.

    At most `limit` rows a call (at most 100,000); the `X-Next-Cursor` response header,
    passed back as `cursor=`, gives the next page (with the same filters), until a page comes
    without it. `name=` takes the metric names of docs/metrics.md (or any other name stored
    for the trial); an unknown name is a 422 naming `name`, not an empty list."""
    start = decode_cursor(cursor)
    trial_id = trial.id
    _check_names(session, trial_id, name or [])
    rows = queries.metric_series(
        session,
        trial_id,
        names=name,
        layer=layer,
        head=head,
        step_min=step_min,
        step_max=step_max,
        limit=limit + 1,
        start=start,
    )
    if len(rows) > limit:
        nxt = rows[limit]
        token = encode_cursor((nxt.name, nxt.layer, nxt.head, nxt.step))
        response.headers[NEXT_CURSOR] = token
        url = request.url.include_query_params(cursor=token)
        response.headers["Link"] = f'<{url}>; rel="next"'
        rows = rows[:limit]
    return [
        MetricOut(
            name=r.name,
            layer=queries.index_or_none(r.layer),
            head=queries.index_or_none(r.head),
            step=r.step,
            value=r.value,
        )
        for r in rows
    ]
