"""The statuses each operation can answer, in the OpenAPI document.

Routes name their own outcomes (`responses=` with `not_found("study")` and the like); what
is the same for every route is added here, once, to the finished document:

- 422: FastAPI documents request-validation errors with its own `HTTPValidationError`
  body, but this API answers every error with `ErrorBody` (service/api/errors.py), so
  the 422 of every operation refers to `ErrorBody`;
- 401: with API tokens configured, every operation but the public ones (`/healthz`)
  answers 401 without a valid bearer token;
- path parameters are listed in the order of the path (FastAPI lists a route's own before
  those of its dependencies, such as `StudyDep`'s `study_id`).
"""

from __future__ import annotations

import re
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
            _path_order(path, op.get("parameters", []))
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


def _path_order(path: str, parameters: list[dict[str, Any]]) -> None:
    """Put the path parameters into the order of `path`, in place (in their own slots)."""
    names = re.findall(r"{(\w+)", path)
    slots = [i for i, p in enumerate(parameters) if p.get("in") == "path"]
    ordered = sorted(
        (parameters[i] for i in slots),
        key=lambda p: names.index(p["name"]) if p["name"] in names else len(names),
    )
    for i, p in zip(slots, ordered, strict=True):
        parameters[i] = p
