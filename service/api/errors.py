"""Every error is JSON a person can act on: {error, message, errors: [{field, message}]}."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, PendingRollbackError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.schemas import ErrorBody, FieldError
from service.errors import InvalidField
from service.store import DatabaseUnavailable, database_away

__all__ = [
    "RETRY_AFTER_S",
    "ApiError",
    "field_errors",
    "install_error_handlers",
    "joined",
    "validation_errors",
]

RETRY_AFTER_S = 5  # what a 503 asks a client to wait while the database is away


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        error: str,
        message: str,
        errors: list[FieldError] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.error, self.message, self.errors = status, error, message, errors or []
        self.headers = headers  # e.g. Retry-After on a 429


def field_errors(errors: Iterable[InvalidField]) -> list[FieldError]:
    """The `errors` list of a body: one entry per bad field."""
    return [FieldError(field=e.field, message=e.message) for e in errors]


def joined(errors: Iterable[InvalidField]) -> str:
    """The `message` of a body that names several fields."""
    return "; ".join(str(e) for e in errors)


def validation_errors(
    exc: ValidationError | RequestValidationError, prefix: str = ""
) -> list[FieldError]:
    out = []
    for e in exc.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidField):  # a cross-field check that knows its field
            out.append(FieldError(field=f"{prefix}{cause.field}", message=cause.message))
            continue
        loc = [str(x) for x in e["loc"] if x not in ("body", "query", "path")]
        # Drop pydantic's union-tag segment (search_space.<path>.float.low -> <path>.low).
        if len(loc) > 2 and loc[0] == "search_space" and loc[2] in _PARAM_TAGS:
            del loc[2]
        field = ".".join(loc) or "body"
        out.append(FieldError(field=f"{prefix}{field}", message=str(e["msg"])))
    return out


_PARAM_TAGS = ("float", "int", "categorical", "fixed")


def _json(status: int, body: ErrorBody, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        body = ErrorBody(error=exc.error, message=exc.message, errors=exc.errors)
        return _json(exc.status, body, headers=exc.headers)

    @app.exception_handler(InvalidField)
    async def _invalid_field(_: Request, exc: InvalidField) -> JSONResponse:
        """A bad spec field or query parameter, whichever module found it: one 422."""
        return _json(
            422,
            ErrorBody(error="validation_error", message=str(exc), errors=field_errors([exc])),
        )

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = validation_errors(exc)
        msg = "; ".join(f"{e.field}: {e.message}" for e in errors)
        return _json(422, ErrorBody(error="validation_error", message=msg, errors=errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error"
        )
        return _json(
            exc.status_code,
            ErrorBody(error=kind, message=str(exc.detail)),
            headers=getattr(exc, "headers", None),
        )

    async def _database(request: Request, exc: Exception) -> JSONResponse:
        """The database is away (a refused or dropped connection): 503 with Retry-After, so
        clients wait and retry instead of taking a 500 for a bug. Any other database error
        goes on to the 500 handler."""
        if not database_away(exc):
            raise exc
        if (health := getattr(request.app.state, "db_health", None)) is not None:
            health.saw(exc)  # /healthz says so at once, until the next probe answers
        return _json(
            503,
            ErrorBody(
                error="database_unavailable",
                message="the database is unreachable; retry later",
            ),
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    # Optuna's storage wraps them (StorageInternalError ... from e): database_away reads the
    # chain, and a handler for Exception would only run after Starlette's 500 (re-raised).
    for cls in (DBAPIError, PendingRollbackError, DatabaseUnavailable, _optuna_storage_error()):
        app.add_exception_handler(cls, _database)


def _optuna_storage_error() -> type[Exception]:
    from optuna.exceptions import StorageInternalError

    return StorageInternalError
