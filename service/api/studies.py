"""/v1/studies: submit, list, inspect, cancel; a study's trials, summary and best trials."""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any

import anyio
import anyio.to_thread
import yaml
from fastapi import APIRouter, Header, Query, Request, Response, status
from pydantic import Field, ValidationError
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool

from service.api.admission import admit
from service.api.deps import (
    MAX_ID,
    LauncherDep,
    SessionDep,
    SettingsDep,
    StoreDep,
    StudyDep,
    load_study,
)
from service.api.errors import ApiError, field_errors, joined, validation_errors
from service.api.openapi import error, not_found
from service.api.schemas import FieldError, Page, StudyOut, TrialOut
from service.config import Settings
from service.control.cancel import cancel_study
from service.control.launch import launch_study
from service.control.ray_cluster import JobLauncher
from service.errors import InvalidField
from service.read import best, queries
from service.resources import unmet
from service.spec import StudySpec, check_data_dirs, check_limits, parse_spec
from service.store import (
    STANDBY,
    Store,
    Study,
    StudyStatus,
    TrialState,
    database_away,
    session_scope,
)

__all__ = ["router"]

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["studies"])

Offset = Annotated[int, Query(ge=0, le=MAX_ID)]

SPEC_EXAMPLE = """name: demo
base:
  task: {kind: associative_recall, seq_len: 32, n_pairs: 4}
  steps: 200
search_space:
  regularizer.lambda: {type: float, low: 0.0001, high: 1.0, log: true}
budget: {n_trials: 8}
"""


# A body over the limit is still read (and discarded) up to this much more, so that clients
# that send it all before reading (urllib, most SDKs) see the 413 instead of a reset.
DRAIN_BYTES = 16 * 1024 * 1024


async def _read_spec(request: Request, max_bytes: int) -> StudySpec:
    too_large = ApiError(413, "payload_too_large", f"study definition exceeds {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    waits = "100-continue" in request.headers.get("expect", "").lower()
    if waits and declared.isdigit() and int(declared) > max_bytes:
        raise too_large  # the client waits for "100 Continue": answer before it sends
    body = bytearray()
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen <= max_bytes:
            body += chunk
        elif seen > max_bytes + DRAIN_BYTES:
            break
    if seen > max_bytes:
        raise too_large
    ctype = request.headers.get("content-type", "application/json").lower()
    if not any(k in ctype for k in ("json", "yaml", "yml", "text/plain")):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send application/json or application/yaml, not {ctype!r}",
        )
    try:
        return await run_in_threadpool(parse_spec, bytes(body), ctype)  # off the event loop
    except InvalidField:
        raise  # a 422 naming the field (service/api/errors.py), not a parse error below
    except ValidationError as e:
        errors = validation_errors(e)
        msg = "; ".join(f"{x.field}: {x.message}" for x in errors)
        raise ApiError(422, "validation_error", msg, errors) from None
    except (ValueError, RecursionError, yaml.YAMLError) as e:  # JSON/UTF-8/int-size errors
        raise ApiError(
            400,
            "parse_error",
            f"body is not valid JSON/YAML: {str(e)[:300]}",
            [FieldError(field="body", message="parse error")],
        ) from None


@router.post(
    "/studies",
    status_code=status.HTTP_201_CREATED,
    response_model=StudyOut,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/StudySpec"}},
                "application/yaml": {"schema": {"type": "string"}, "example": SPEC_EXAMPLE},
            },
        }
    },
    responses={
        200: {
            "model": StudyOut,
            "description": "the study an earlier request with this Idempotency-Key created",
        },
        400: error("the body is not valid JSON or YAML"),
        413: error("the body is larger than QKSCOPE_MAX_BODY_BYTES"),
        415: error("a content type other than JSON or YAML"),
        422: error("an invalid study definition, every bad field named in errors[].field"),
        429: error("as many studies are live as QKSCOPE_MAX_LIVE_STUDIES allows; see Retry-After"),
    },
)
async def submit_study(
    request: Request,
    response: Response,
    settings: SettingsDep,
    store: StoreDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> StudyOut:
    """Validate a study definition (JSON or YAML), store it, and start its Ray job.

    Only reading the body happens on the event loop. Everything that may block (the data
    directory's symlinks, the limits, Ray's node list, the database, the job submission:
    up to `JOB_SERVER_TIMEOUT_S` when Ray is slow) runs in a worker thread, under a limiter
    of its own (`SUBMIT_THREADS`), so a slow Ray neither stalls the loop (`/healthz`) nor
    takes every thread of the pool that serves the other routes."""
    spec = await _read_spec(request, settings.max_body_bytes)
    limiter: anyio.CapacityLimiter = request.app.state.submit_limiter
    row, created = await anyio.to_thread.run_sync(
        functools.partial(
            _store_and_launch, spec, settings, store, request.app.state, idempotency_key
        ),
        limiter=limiter,
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return row


# POSTs that may wait on Ray at once (each holds a thread of their own limiter).
SUBMIT_THREADS = 16


def _store_and_launch(
    spec: StudySpec,
    settings: Settings,
    store: Store,
    state: Any,
    idempotency_key: str | None,
) -> tuple[StudyOut, bool]:
    """The blocking part of a POST, in order: checks, the row committed PENDING, then (only
    then) the Ray job submitted; a submit that fails or times out leaves the study PENDING
    for the reconciler. Returns the study and whether it was created."""
    path_errors = check_data_dirs(spec, settings.data_dir)
    if path_errors:
        raise ApiError(422, "validation_error", joined(path_errors), field_errors(path_errors))
    limit_errors = check_limits(
        spec,
        max_trials=settings.max_trials,
        max_steps=settings.max_steps,
        max_params=settings.max_params,
        max_memory=settings.max_trial_memory_bytes,
        limits=settings.limits(),
    )
    if limit_errors:
        raise ApiError(422, "limit_exceeded", joined(limit_errors), field_errors(limit_errors))
    launcher: JobLauncher | None = state.launcher()  # connects on first use
    if launcher is not None and settings.check_resources:
        nodes = launcher.node_resources()
        unmet_ = unmet(spec.resources.cpus, spec.resources.gpus, nodes) if nodes else []
        if unmet_:
            raise ApiError(
                422,
                "unsatisfiable_resources",
                "; ".join(f"{f}: {m}" for f, m in unmet_),
                [FieldError(field=f, message=m) for f, m in unmet_],
            )
    with admit(state.sessions, settings, idempotency_key):  # a 429 past the live cap
        row, created = store.studies.create(spec, idempotency_key)
    if not created:
        return StudyOut.of(row), False
    if launcher is not None:
        try:
            launch_study(store, launcher, settings, row.id, seen_attempts=0)
        except Exception as e:  # the reconciler retries PENDING studies
            log.warning("study %d stays PENDING: submit failed: %s", row.id, e)
            if not database_away(e):  # the database: the study was created all the same
                store.studies.mark_ray_unreachable(settings.ray_address, e, study_id=row.id)
    elif settings.ray_address:  # the job server did not answer when we last tried
        store.studies.mark_ray_unreachable(settings.ray_address, "no connection", study_id=row.id)
    with session_scope(state.sessions) as session:
        return StudyOut.of(load_study(session, row.id)), True


@router.get("/studies", response_model=Page[StudyOut])
def list_studies(
    session: SessionDep,
    status_: Annotated[str | None, Query(alias="status", pattern="^[A-Za-z]{1,16}$")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Offset = 0,
) -> Page[StudyOut]:
    q = select(Study).where(Study.status != STANDBY)  # a standby is no study (store/standbys.py)
    if status_:
        if status_.upper() not in StudyStatus.__members__:
            raise ApiError(
                422,
                "validation_error",
                f"status: unknown status {status_!r}",
                [FieldError(field="status", message=f"one of {list(StudyStatus)}")],
            )
        q = q.where(Study.status == status_.upper())
    total = session.scalar(select(func.count()).select_from(q.subquery())) or 0
    rows = session.scalars(q.order_by(Study.id.desc()).limit(limit).offset(offset)).all()
    return Page[StudyOut](
        items=[StudyOut.of(r) for r in rows], total=total, limit=limit, offset=offset
    )


@router.get("/studies/{study_id}", response_model=StudyOut, responses=not_found("study"))
def get_study(study: StudyDep) -> StudyOut:
    return StudyOut.of(study)


@router.post("/studies/{study_id}/cancel", response_model=StudyOut, responses=not_found("study"))
def cancel(
    session: SessionDep,
    settings: SettingsDep,
    launcher: LauncherDep,
    store: StoreDep,
    study: StudyDep,
) -> StudyOut:
    """Stop the study's Ray job and its trials (in Optuna's storage too); finished studies
    are left as they are."""
    study_id = study.id
    session.close()
    row = cancel_study(store, launcher, study_id, settings.resolved_database_url())
    assert row is not None
    return StudyOut.of(row)


def _check_param_filter(study: Study, field: str, query_param: str) -> None:
    name = field.removeprefix("params.")
    space = study.spec.get("search_space", {})
    if name not in space:
        raise ApiError(
            422,
            "validation_error",
            f"{field}: not a parameter of this study",
            [FieldError(field=query_param, message=f"{name!r} is not in the search space")],
        )
    if space[name].get("type") not in ("float", "int"):
        raise ApiError(
            422,
            "validation_error",
            f"{field}: only numeric parameters can be compared",
            [FieldError(field=query_param, message=f"{name!r} is categorical")],
        )


_FIELDS = ", ".join(queries.SORTABLE)
_WHERE_DOC = (
    f"`FIELD OP NUMBER`, OP one of >=, <=, >, <, =; FIELD is params.<path> or one of {_FIELDS}"
    " (flags: `trapped=1` / `trapped=0`). Repeat to combine (and)."
)
_SORT_DOC = f"params.<path> or one of {_FIELDS}; a leading `-` sorts descending."


@router.get(
    "/studies/{study_id}/trials", response_model=Page[TrialOut], responses=not_found("study")
)
def list_trials(
    session: SessionDep,
    study: StudyDep,
    state: Annotated[list[TrialState] | None, Query()] = None,
    penalty_version: Annotated[list[Annotated[int, Field(ge=1, le=1000)]] | None, Query()] = None,
    where: Annotated[list[str] | None, Query(max_length=20, description=_WHERE_DOC)] = None,
    sort: Annotated[str, Query(max_length=100, description=_SORT_DOC)] = "number",
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    offset: Offset = 0,
) -> Page[TrialOut]:
    """Filter (`state=`, `penalty_version=2`, `where=min_norm_entropy>=0.1`,
    `where=params.regularizer.lambda<0.1`), sort (`sort=-final_val_loss`,
    `sort=params.model.qk_init_std`) and page a study's trials. `penalty_version` is the
    eigenspectrum-penalty definition that trained a trial (docs/metrics.md section 4)."""
    # A bad `where`/`sort` is a queries.QueryError: a 422 naming it (service/api/errors.py).
    filters = [queries.parse_filter(w) for w in where or []]
    for f in filters:
        if f.field.startswith("params."):
            _check_param_filter(study, f.field, "where")
    if sort.lstrip("-+").startswith("params."):
        _check_param_filter(study, sort.lstrip("-+"), "sort")
    rows, total = queries.list_trials(
        session,
        study.id,
        states=[s.value for s in state or []],
        penalty_versions=penalty_version,
        filters=filters,
        sort=sort,
        limit=limit,
        offset=offset,
    )
    return Page[TrialOut](
        items=[TrialOut.of(r) for r in rows], total=total, limit=limit, offset=offset
    )


@router.get("/studies/{study_id}/summary", responses=not_found("study"))
def summary(session: SessionDep, study: StudyDep) -> dict[str, Any]:
    """Counts by state, collapse rates, best value, progress and ETA."""
    return queries.study_summary(session, study)


@router.get("/studies/{study_id}/best", response_model=list[TrialOut], responses=not_found("study"))
def best_trials(session: SessionDep, study: StudyDep, feasible_only: bool = True) -> list[TrialOut]:
    """The best trial (one objective) or the Pareto front (several), among COMPLETE trials;
    each with its summary, bounded (service/read/best.py)."""
    return [
        TrialOut.of(r, with_summary=True) for r in best.best_trials(session, study, feasible_only)
    ]
