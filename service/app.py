"""The FastAPI app factory. Engines and the Ray client are made in `lifespan`, not at import;
the background control loop (service/control/reconciler.py) runs beside the routes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool

from service.api import (
    export,
    importance,
    lr_sensitivity,
    plots,
    series,
    stability_boundary,
    studies,
    trials,
    ui,
)
from service.api.deps import require_token, token_digest
from service.api.errors import install_error_handlers
from service.api.ops import install_ops
from service.config import Settings, get_settings
from service.control.db_health import DatabaseHealth, watch_database
from service.control.reconciler import LauncherSlot, reconcile_forever
from service.control.standby import retire_standbys
from service.read import prom
from service.read.importance import ImportanceCache
from service.store import Store, make_engine, make_reader, make_sessionmaker, ping, upgrade_schema
from service.ui import mount_ui

__all__ = ["create_app"]

ROUTERS = (
    studies,
    trials,
    plots,
    export,
    importance,
    lr_sensitivity,
    stability_boundary,
    series,
    ui,
)


def _lifespan(
    settings: Settings, reconcile_loop: bool
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url()
        await run_in_threadpool(upgrade_schema, url)
        engine = make_engine(url)
        app.state.settings = settings
        app.state.sessions = make_reader(engine)  # the read side: refuses any write
        app.state.store = Store(make_sessionmaker(engine))  # the only writer
        app.state.importance = ImportanceCache()
        app.state.token_digests = [token_digest(t) for t in settings.token_list()]
        app.state.launcher = LauncherSlot(settings.ray_address)
        # POST /v1/studies waits on Ray in threads of its own (service/api/studies.py).
        app.state.submit_limiter = anyio.CapacityLimiter(studies.SUBMIT_THREADS)
        probe = asyncio.create_task(
            watch_database(app.state.db_health, functools.partial(ping, app.state.sessions))
        )
        task: asyncio.Task[Any] | None = None
        if reconcile_loop:
            loop = reconcile_forever(
                app.state.store, app.state.launcher, settings, app.state.reconcile_rounds
            )
            task = asyncio.create_task(loop)
        try:
            yield
        finally:
            for t in (task, probe):
                if t is not None:
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
            if reconcile_loop:  # the standbys this loop kept: their runners exit
                with contextlib.suppress(Exception):
                    await run_in_threadpool(retire_standbys, app.state.store)
            await run_in_threadpool(engine.dispose)

    return lifespan


def create_app(settings: Settings | None = None, *, reconcile_loop: bool = True) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="qkscope",
        version="0.1.0",
        summary="Which training settings keep a transformer's attention healthy?",
        lifespan=_lifespan(settings, reconcile_loop),
        # Served by install_ops behind the token like every route but /healthz.
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.db_health = DatabaseHealth()  # /healthz's view of the database
    install_error_handlers(app)
    for module in ROUTERS:
        app.include_router(module.router, dependencies=[Depends(require_token)])
    mount_ui(app)  # static files only, no token: every data route they call needs one
    registry = prom.make_registry(lambda: app.state.sessions)
    app.state.reconcile_rounds = prom.reconcile_counter(registry)
    install_ops(app, registry, tokens=bool(settings.token_list()))
    return app
