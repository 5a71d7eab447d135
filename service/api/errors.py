"""Every error is JSON a person can act on: {error, message, errors: [{field, message}]}."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.schemas import ErrorBody, FieldError

__all__ = ["ApiError", "install_error_handlers", "validation_errors"]


class ApiError(Exception):
    def __init__(
        self, status: int, error: str, message: str, errors: list[FieldError] | None = None
    ):
        super().__init__(message)
        self.status, self.error, self.message, self.errors = status, error, message, errors or []


def validation_errors(
    exc: ValidationError | RequestValidationError, prefix: str = ""
) -> list[FieldError]:
    from service.spec import SpecError

    out = []
    for e in exc.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):  # a cross-field check that knows its field
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
        return _json(exc.status, ErrorBody(error=exc.error, message=exc.message, errors=exc.errors))

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
