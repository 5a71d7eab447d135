"""The statuses each operation can answer, in the OpenAPI document.

Routes name their own outcomes (`responses=` with `not_found("study")` and the like); what
is the same for every route is added here, once, to the finished document:

- 422: FastAPI documents request-validation errors with its own `HTTPValidationError`
  body, but this API answers every error with `ErrorBody` (service/api/errors.py), so
  the 422 of every operation refers to `ErrorBody`;
- 401: with API tokens configured, every operation but the public ones (`/healthz`)
  answers 401 without a valid bearer token.
"""

from __future__ import annotations

from typing import Any

from service.api.schemas import ErrorBody

__all__ = ["PUBLIC_PATHS", "complete_statuses", "error", "not_found"]

PUBLIC_PATHS = frozenset({"/healthz"})
_REF = "#/components/schemas/ErrorBody"


def error(description: str) -> dict[str, Any]:
    """One error status for a route's `responses=`: an `ErrorBody` and what it means."""
    return {"model": ErrorBody, "description": description}


def not_found(what: str) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route that reads one study or trial by id."""
    return {404: error(f"no such {what}")}


def _error_doc(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF}}}}


def complete_statuses(schema: dict[str, Any], *, auth: bool) -> dict[str, Any]:
    """Rewrite `schema` in place (and return it): ErrorBody for 422, 401 where tokens apply."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault(
        "ErrorBody", ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    )
    for defs in (components["ErrorBody"].pop("$defs", {}),):
        for name, sub in defs.items():
            components.setdefault(name, sub)
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            r422 = responses.get("422")
            if r422 is not None and "HTTPValidationError" in str(r422):
                responses["422"] = _error_doc("a bad parameter or body, named in errors[].field")
            if auth and path not in PUBLIC_PATHS:
                responses.setdefault(
                    "401", _error_doc("missing or invalid bearer token (API tokens are on)")
                )
    if "HTTPValidationError" not in str(schema.get("paths", {})):
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
    return schema
