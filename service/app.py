"""The FastAPI app factory. Engines and the Ray client are made in `lifespan`, not at import."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from service.api import export, importance, plots, series, studies, trials, ui
from service.api.deps import require_token, token_digest
from service.api.errors import install_error_handlers
from service.api.openapi import complete_statuses
from service.config import Settings, get_settings
from service.control.launch import reconcile
from service.control.ray_cluster import JobLauncher
from service.read import prom
from service.read.importance import ImportanceCache
from service.spec import StudySpec
from service.store import Store, migrate
from service.store.session import make_engine, make_reader, make_sessionmaker
from service.ui import mount_ui

__all__ = ["create_app"]

log = logging.getLogger("qkscope.app")


class LauncherSlot:
    """Connects to Ray's job server on first use; retries at most every few seconds."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._launcher: JobLauncher | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> JobLauncher | None:
        if not self.address:
            return None
        with self._lock:
            if self._launcher is None and time.monotonic() >= self._next_try:
                try:
                    self._launcher = JobLauncher(self.address)
                except Exception as e:
                    log.warning("Ray job server at %s unreachable: %s", self.address, e)
                    self._next_try = time.monotonic() + 5.0
            return self._launcher


def create_app(settings: Settings | None = None, *, reconcile_loop: bool = True) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url()
        await run_in_threadpool(migrate.upgrade, url)
        engine = make_engine(url)
        app.state.settings = settings
        app.state.sessions = make_reader(engine)  # the read side: refuses any write
        app.state.store = Store(make_sessionmaker(engine))  # the only writer
        app.state.importance = ImportanceCache()
        app.state.token_digests = [token_digest(t) for t in settings.token_list()]
        app.state.launcher = LauncherSlot(settings.ray_address)
        task = asyncio.create_task(_reconcile_forever(app)) if reconcile_loop else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            engine.dispose()

    app = FastAPI(
        title="qkscope",
        version="0.1.0",
        summary="Which training settings keep a transformer's attention healthy?",
        lifespan=lifespan,
        # Served below behind the token like every route but /healthz.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    install_error_handlers(app)
    auth = [Depends(require_token)]
    app.include_router(studies.router, dependencies=auth)
    app.include_router(trials.router, dependencies=auth)
    app.include_router(plots.router, dependencies=auth)
    app.include_router(export.router, dependencies=auth)
    app.include_router(importance.router, dependencies=auth)
    app.include_router(series.router, dependencies=auth)
    app.include_router(ui.router, dependencies=auth)
    mount_ui(app)  # static files only, no token: every data route they call needs one
    registry = prom.make_registry(lambda: app.state.sessions)
    app.state.reconcile_rounds = prom.reconcile_counter(registry)

    def openapi() -> dict[str, Any]:
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
            app.openapi_schema = complete_statuses(schema, auth=bool(settings.token_list()))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    def openapi_json() -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    def docs() -> HTMLResponse:
        """Swagger UI. With tokens configured, the browser must send the bearer header too."""
        return get_swagger_ui_html(openapi_url="/openapi.json", title="qkscope API")

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

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

    return app


async def _reconcile_forever(app: FastAPI) -> None:
    """Launch PENDING studies and relaunch RUNNING ones whose Ray job died."""
    settings: Settings = app.state.settings
    while True:
        launcher = await run_in_threadpool(app.state.launcher)
        if launcher is None and settings.ray_address:
            try:  # no job client yet: Ray's job server has not answered since we started
                await run_in_threadpool(
                    app.state.store.studies.mark_ray_unreachable,
                    settings.ray_address,
                    "no connection",
                )
            except Exception:
                log.exception("marking studies as waiting for Ray failed")
        if launcher is not None:
            try:
                await run_in_threadpool(reconcile, app.state.store, launcher, settings)
            except Exception:
                log.exception("reconcile failed")
        app.state.reconcile_rounds.inc()  # observable proof the loop ran (Prometheus)
        await asyncio.sleep(settings.reconcile_interval_s)
