"""/v1/studies/{id}/export: a study's trials (and metric rows) as CSV or Parquet, streamed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api.deps import SessionDep, StudyDep
from service.api.errors import ApiError
from service.api.schemas import ErrorBody, FieldError
from service.read.export import MEDIA_TYPES, export_stream

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["export"])

EXPORT_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "one table (CSV or Parquet), or with metrics=true a zip of both",
        "content": {"text/csv": {}, "application/vnd.apache.parquet": {}, "application/zip": {}},
    },
    404: {"model": ErrorBody, "description": "no such study"},
    422: {"model": ErrorBody, "description": "a bad parameter, named in errors[].field"},
}


@router.get(
    "/studies/{study_id}/export",
    response_class=StreamingResponse,
    responses=EXPORT_DOC,
)
def export_study(
    request: Request,
    session: SessionDep,
    study: StudyDep,
    format: Literal["csv", "parquet"] = "csv",
    metrics: bool = False,
    table: Literal["trials", "metrics"] | None = None,
) -> StreamingResponse:
    """`table=trials` (default): one row per trial, with `params.<path>` and summary columns.
    `table=metrics`: the long table of metric rows (number, trial_id, name, layer, head, step,
    value). `metrics=true`: a zip holding both, `trials.<format>` and `metrics.<format>`."""
    if metrics and table is not None:
        raise ApiError(
            422,
            "validation_error",
            "table: metrics=true exports both tables as a zip; leave table out, or drop metrics",
            [FieldError(field="table", message="not allowed together with metrics=true")],
        )
    study_id = study.id
    session.close()
    what: Literal["trials", "metrics", "both"] = "both" if metrics else (table or "trials")
    stream = export_stream(request.app.state.sessions, study_id, format, what)
    first = next(stream, b"")  # fail here, as a JSON error, rather than mid-stream

    def body() -> Iterator[bytes]:
        yield first
        yield from stream

    if what == "both":
        media, filename = "application/zip", f"study-{study_id}-{format}.zip"
    else:
        media, filename = MEDIA_TYPES[format], f"study-{study_id}-{what}.{format}"
    return StreamingResponse(
        body(),
        media_type=media,
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )
