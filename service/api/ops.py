"""Routes for operators: /healthz (no token), /metrics (Prometheus), the OpenAPI schema and
Swagger UI behind the token, and the JSON Schema of a study definition."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry

from service.api.deps import require_token
from service.api.openapi import complete_statuses
from service.read import prom
from service.spec import StudySpec

__all__ = ["install_ops"]


def _schema(app: FastAPI, auth: bool) -> dict[str, Any]:
    """FastAPI's schema plus the StudySpec the raw-body POST refers to."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        spec = StudySpec.model_json_schema(
            by_alias=True, ref_template="#/components/schemas/{model}"
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(spec.pop("$defs", {}))
        components["StudySpec"] = spec
        app.openapi_schema = complete_statuses(schema, auth=auth)
    return app.openapi_schema


def install_ops(app: FastAPI, registry: CollectorRegistry, tokens: bool) -> None:
    """Add the operator routes; every one but /healthz needs the token when `tokens`."""
    auth = [Depends(require_token)]
    app.openapi = lambda: _schema(app, tokens)  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    def openapi_json() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    def docs() -> HTMLResponse:
        """Swagger UI. With tokens configured, the browser must send the bearer header too."""
        return get_swagger_ui_html(openapi_url="/openapi.json", title="qkscope API")

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """200 while the API process serves, on the event loop itself (no I/O: it answers
        while every worker thread is busy); `database` says whether the API reaches the
        database (up, down, unknown before the first probe), from the background probe's
        last result (service/control/db_health.py), never from a query here."""
        return app.state.db_health.report()  # type: ignore[no-any-return]

    @app.get(
        "/metrics",
        tags=["ops"],
        dependencies=auth,
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus metrics"}},
    )
    def metrics(request: Request) -> Response:
        """Prometheus exposition: studies and trials by state, trial durations, metric rows
        written; read from the database at scrape time. Bearer token like the API."""
        body, content_type = prom.exposition(registry, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/spec-schema", tags=["studies"], dependencies=auth)
    def spec_schema() -> dict[str, Any]:
        """JSON Schema of a study definition."""
        return StudySpec.model_json_schema(by_alias=True)
