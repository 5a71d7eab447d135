"""/v1/trials/{id}/series: a trial's metric rows grouped into series, in one columnar call.

`/metrics` answers one JSON object per stored row, which is what a script wants; a page
drawing a layer x head heatmap over hundreds of evaluations wants the same rows grouped
by (name, layer, head) with the steps and values as two parallel arrays: about a third of
the bytes, and no per-row objects to build on either side (100,000 rows: one call; more
than MAX_ROWS come in pages, `next_cursor`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, Field
from sqlalchemy import Row

from service.api.deps import SessionDep, TrialDep
from service.api.errors import ApiError
from service.api.openapi import not_found
from service.api.paging import decode_cursor, encode_cursor
from service.api.schemas import FieldError
from service.read import queries

__all__ = ["MAX_ROWS", "SeriesOut", "TrialSeriesOut", "router"]

router = APIRouter(prefix="/v1", tags=["trials"])

MAX_INT = 2**31 - 1  # PostgreSQL integer
MAX_ROWS = 200_000  # rows one call returns at most (`next_cursor` gives the rest, page by page)
MetricName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_]{1,64}$")]


class SeriesOut(BaseModel):
    """One (name, layer, head) series; `steps` and `values` are parallel, steps ascending."""

    name: str
    layer: int | None
    head: int | None
    steps: list[int]
    values: list[float | None]


class TrialSeriesOut(BaseModel):
    trial_id: int
    rows: int = Field(description="metric rows in `series`, all series together")
    truncated: bool = Field(description="true when more rows follow this page (next_cursor)")
    next_cursor: str | None = Field(
        None,
        description=(
            "pass as cursor= (with the same filters) for the next page; null on the last. "
            "A series can continue on the next page: append its steps and values"
        ),
    )
    series: list[SeriesOut] = Field(description="ordered by (name, layer, head)")


def _group(rows: Sequence[Row[str, int, int, int, float | None]]) -> list[SeriesOut]:
    """Rows ordered by (name, layer, head, step) as one series per (name, layer, head)."""
    series: list[SeriesOut] = []
    key: tuple[str, int, int] | None = None
    for r in rows:
        k = (r[0], r[1], r[2])
        if k != key:
            key = k
            series.append(
                SeriesOut(
                    name=r[0],
                    layer=queries.index_or_none(r[1]),
                    head=queries.index_or_none(r[2]),
                    steps=[],
                    values=[],
                )
            )
        series[-1].steps.append(r[3])
        series[-1].values.append(r[4])
    return series


@router.get(
    "/trials/{trial_id}/series",
    response_model=TrialSeriesOut,
    responses=not_found("trial"),
)
def get_series(
    session: SessionDep,
    trial: TrialDep,
    name: Annotated[list[MetricName] | None, Query(max_length=50)] = None,
    step_min: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_ROWS)] = MAX_ROWS,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> TrialSeriesOut | Response:
    """The trial's metric rows (all names, or those of `name=`) grouped by (name, layer,
    head): what the web UI's heatmaps and curves draw. layer/head are null where the metric
    has none (docs/metrics.md says which). At most `limit` rows a call (at most 200,000):
    `next_cursor`, passed back as `cursor=`, gives the next page."""
    start = decode_cursor(cursor)
    # On PostgreSQL the database writes the series' JSON (queries.metric_series_json); on
    # SQLite they are grouped here from the rows.
    trial_id = trial.id
    if step_min is not None and step_max is not None and step_min > step_max:
        raise ApiError(
            422,
            "validation_error",
            "step_min: greater than step_max",
            [FieldError(field="step_min", message="must be <= step_max")],
        )
    grouped = queries.metric_series_json(
        session,
        trial_id,
        names=name,
        step_min=step_min,
        step_max=step_max,
        limit=limit,
        start=start,
    )
    if grouped is not None:  # PostgreSQL wrote the series (same shape, same order)
        return _json_page(trial_id, *grouped)
    rows = queries.metric_series(
        session,
        trial_id,
        names=name,
        step_min=step_min,
        step_max=step_max,
        limit=limit + 1,
        start=start,
    )
    return _page(trial_id, rows, limit)


def _json_page(trial_id: int, n: int, series_json: str, nxt: queries.MetricKey | None) -> Response:
    """The page around the series' JSON that PostgreSQL wrote."""
    more = "null" if nxt is None else json.dumps(encode_cursor(nxt))
    body = (
        f'{{"trial_id":{trial_id},"rows":{n},"truncated":{"true" if nxt else "false"},'
        f'"next_cursor":{more},"series":{series_json}}}'
    )
    return Response(body, media_type="application/json")


def _page(
    trial_id: int, rows: Sequence[Row[str, int, int, int, float | None]], limit: int
) -> TrialSeriesOut:
    """`limit` of the rows (asked for one more: it says where the next page starts), grouped."""
    next_cursor = None
    if len(rows) > limit:
        r = rows[limit]
        next_cursor = encode_cursor((r.name, r.layer, r.head, r.step))
    return TrialSeriesOut(
        trial_id=trial_id,
        rows=min(len(rows), limit),
        truncated=next_cursor is not None,
        next_cursor=next_cursor,
        series=_group(rows[:limit]),
    )
