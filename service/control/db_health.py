"""Whether the API process can reach its database, as /healthz reports it.

/healthz must answer in milliseconds whatever the database does (the compose healthcheck
gives it 3 s), so it never queries the database itself: it reads what a background probe
(`watch_database`, a `SELECT 1` every few seconds, off the event loop) and the 503 handler
(a request that met a database that is away) last saw. /healthz answers 200 either way: the
API process is alive and answers 503 with Retry-After while the database is away, and a
restart of the API would not bring the database back. Its body says `database: down`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

__all__ = ["PROBE_INTERVAL_S", "DatabaseHealth", "watch_database"]

log = logging.getLogger("qkscope.app")
PROBE_INTERVAL_S = 5.0


@dataclass
class DatabaseHealth:
    """The database's state as last seen: None before the first probe."""

    up: bool | None = None
    error: str | None = None
    since: float | None = None  # unix time of the last change

    def saw(self, error: BaseException | None) -> None:
        """Record a probe's or a request's outcome (None: the database answered)."""
        up = error is None
        if up != self.up:
            self.since = time.time()
            if up:
                if self.up is not None:  # not at the first probe: nothing came back
                    log.warning("the database answers again")
            else:
                log.warning("the database is unreachable: %s", error)
        self.up = up
        # Only the kind of error: /healthz needs no token, and a driver's message names the
        # database's host, port, user or file (the log keeps the whole message).
        self.error = None if error is None else _kind(error)

    def report(self) -> dict[str, str]:
        """/healthz's body: up, down or unknown, and while down the kind of error (its class,
        e.g. `OperationalError`), never the driver's message."""
        if self.up is None:
            return {"status": "ok", "database": "unknown"}
        if self.up:
            return {"status": "ok", "database": "up"}
        return {"status": "degraded", "database": "down", "database_error": self.error or ""}


def _kind(error: BaseException) -> str:
    """The error's class, or that of the driver error it wraps (SQLAlchemy's `orig`)."""
    orig = getattr(error, "orig", None)
    return type(orig if isinstance(orig, BaseException) else error).__name__


async def watch_database(
    health: DatabaseHealth, ping: Callable[[], None], interval_s: float = PROBE_INTERVAL_S
) -> None:
    """Probe the database every `interval_s` (in a worker thread); never ends by itself."""
    while True:
        try:
            await run_in_threadpool(ping)
        except Exception as e:  # any failure is "down": the body says why
            health.saw(e)
        else:
            health.saw(None)
        await asyncio.sleep(interval_s)
