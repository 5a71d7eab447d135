"""Engines and sessions: the one place a database connection is made."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, PendingRollbackError
from sqlalchemy.orm import Session, sessionmaker

__all__ = [
    "DEFAULT_OUTAGE_S",
    "EXIT_DATABASE_AWAY",
    "DatabaseUnavailable",
    "ReadOnlyError",
    "database_away",
    "discard_weather_connections",
    "make_engine",
    "make_reader",
    "make_sessionmaker",
    "normalize_url",
    "outage_window",
    "pg_connect_args",
    "ping",
    "session_scope",
    "sqlite_pragmas",
    "with_retry",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


def normalize_url(url: str) -> str:
    """Use the psycopg 3 driver for plain postgresql:// URLs."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    """WAL, busy timeout, foreign keys: for every SQLite connection, ours and Optuna's."""
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the runner's writes
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str) -> Engine:
    """An engine for SQLite (WAL, busy timeout, foreign keys) or PostgreSQL (pre-ping)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", sqlite_pragmas)
        return engine
    engine = create_engine(
        normalize_url(url),
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=20,
        connect_args=pg_connect_args(url),
    )
    event.listen(engine, "handle_error", discard_weather_connections)
    return engine


def discard_weather_connections(ctx: Any) -> None:
    """A statement that failed with a SQLSTATE that says the server is the wrong one for us
    now (`_WEATHER_SQLSTATES`: a read-only server after a failover, one shutting down)
    makes SQLAlchemy treat it as a disconnect: the connection is discarded, not returned to
    the pool, and the pool's other connections (opened to the same server) are invalidated
    with it. `pool_pre_ping` cannot find these: a read-only server answers its ping. The
    error then reads as `connection_invalidated`, which `database_away` and `with_retry`
    take for weather."""
    if _sqlstate(ctx.original_exception) in _WEATHER_SQLSTATES:
        ctx.is_disconnect = True


def pg_connect_args(url: str) -> dict[str, Any]:
    """libpq settings that make a database that went away an error in seconds, not a hang:
    a connect timeout, and TCP keepalives that find a dead connection in about a minute
    (a failover or a network cut leaves the old socket open). Those the URL sets win."""
    wanted = {
        "connect_timeout": 10,
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    query = url.partition("?")[2]
    given = {kv.partition("=")[0] for kv in query.split("&") if kv}
    return {k: v for k, v in wanted.items() if k not in given}


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# How long one unit of work keeps retrying while the database is away (connection errors),
# for the code running in this context: ~24 s by default (the API process: a request or a
# reconcile round gives up soon and tries again later), `Settings.db_outage_s` in a study
# runner (`outage_window`), which must outlast a PostgreSQL restart or failover.
DEFAULT_OUTAGE_S = 24.0
_OUTAGE_S: ContextVar[float] = ContextVar("qkscope_db_outage_s", default=DEFAULT_OUTAGE_S)
# Other errors that may pass (a deadlock, an unknown OperationalError that may be a bug, e.g.
# SQLite's "no such table"): retried this long at most, as before.
TRANSIENT_S = 24.0


# A study runner's exit status when the database stayed away past its outage window
# (EX_TEMPFAIL: try again later). The reconciler reads it from Ray's job list: such a death
# is weather, not charged to max_job_attempts (service/control/reconciler.py).
EXIT_DATABASE_AWAY = 75


class DatabaseUnavailable(Exception):
    """The database stayed away (connection errors) for the whole outage window.

    Not a verdict on the study: a runner that meets it exits leaving the study RUNNING for
    the reconciler to relaunch, and the API answers 503 with Retry-After."""

    def __init__(self, what: str, waited_s: float, cause: BaseException) -> None:
        super().__init__(f"{what}: the database was unreachable for {waited_s:.0f}s ({cause})")
        self.what, self.waited_s = what, waited_s


@contextmanager
def outage_window(seconds: float) -> Iterator[None]:
    """Within this block (this thread or task), `with_retry` waits up to `seconds` for a
    database that is away before it raises `DatabaseUnavailable`."""
    token = _OUTAGE_S.set(seconds)
    try:
        yield
    finally:
        _OUTAGE_S.reset(token)


def with_retry(
    fn: Callable[[], T],
    what: str,
    *,
    outage_s: float | None = None,
    transient_s: float = TRANSIENT_S,
    base_s: float = 0.25,
    max_s: float = 5.0,
) -> T:
    """Run one unit of database work, again after a dropped connection or a locked database.

    Backs off exponentially (0.25 s, 0.5 s, ... capped at `max_s`). While the database is
    away (a refused or dropped connection: `database_away`), it keeps trying for `outage_s`
    (default: the context's `outage_window`, else `DEFAULT_OUTAGE_S`) and then raises
    `DatabaseUnavailable`; other transient errors are retried for `transient_s` and then
    re-raised as they are. The unit must be safe to repeat: a whole transaction, or an
    idempotent call.
    """
    window = _OUTAGE_S.get() if outage_s is None else outage_s
    t0 = time.monotonic()
    i = 0
    while True:
        try:
            return fn()
        except Exception as e:
            cause = _connection_error(e)
            if cause is None or isinstance(e, DatabaseUnavailable):
                raise  # not the database's doing, or a nested unit already waited its window
            away = database_away(e)
            waited = time.monotonic() - t0
            delay = min(max_s, base_s * 2**i)
            if waited + delay > (window if away else min(window, transient_s)):
                if away:
                    raise DatabaseUnavailable(what, waited, cause) from e
                raise
            i += 1
            log.warning(
                "%s: database %s (%s); retry %d in %.2fs",
                what,
                "unreachable" if away else "error",
                cause,
                i,
                delay,
            )
            time.sleep(delay)


def _chain(e: BaseException) -> Iterator[BaseException]:
    """`e` and every exception behind it (`__cause__` and `__context__`), each once."""
    todo: list[BaseException] = [e]
    seen: set[int] = set()
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo.extend(x for x in (err.__cause__, err.__context__) if x is not None)


def _connection_error(e: BaseException) -> BaseException | None:
    """The dropped-connection or locked-database error behind `e`, if there is one.

    Optuna's RDB storage re-raises these as its own StorageInternalError (`raise ... from e`),
    and a dropped connection can surface one step later as SQLAlchemy's PendingRollbackError
    (the session's transaction is invalid; Optuna and `session_scope` roll it back), raised
    while the OperationalError was being handled. So both chains, `__cause__` and
    `__context__`, are searched.
    """
    for err in _chain(e):
        if isinstance(err, DatabaseUnavailable):
            return err
        if isinstance(err, OperationalError | InterfaceError):
            return err.orig if err.orig is not None else err
        if isinstance(err, DBAPIError) and (
            err.connection_invalidated or _sqlstate(err.orig) in _AWAY_SQLSTATES
        ):
            return err.orig if err.orig is not None else err  # e.g. 25006: read-only
        if isinstance(err, PendingRollbackError):
            return err
    return None


# PostgreSQL SQLSTATEs that mean "the server is not there for us now": connection exceptions
# (class 08), the server shutting down or starting up (57P01-57P03), too many connections,
# and a server that is read-only (25006: a standby after a failover, or a primary demoted).
_AWAY_SQLSTATES = ("57P01", "57P02", "57P03", "53300", "25006")
# Those whose connection is discarded at once (`discard_weather_connections`): it is tied to
# a server that is going away or is read-only, and a later use would fail the same way.
_WEATHER_SQLSTATES = ("25006", "57P01", "57P02", "57P03")


def _sqlstate(e: BaseException | None) -> str | None:
    state = getattr(e, "sqlstate", None)
    return state if isinstance(state, str) else None


# SQLite messages that mean the file cannot be used now: another process holds its lock past
# the busy timeout, or it cannot be reached (a lost mount, a failing disk).
_SQLITE_AWAY = (
    "database is locked",
    "database table is locked",
    "unable to open database file",
    "disk i/o error",
)


def database_away(e: BaseException) -> bool:
    """Whether `e` (or an error behind it) says the database is away, not that the work is
    wrong: a refused or dropped connection (SQLAlchemy's `connection_invalidated`, psycopg's
    errors without a SQLSTATE or of class 08, a server shutting down or starting up), a
    session invalidated by one, a read-only server (SQLSTATE 25006: a failover), an SQLite
    file locked past its busy timeout or that cannot be opened. A deadlock, a serialization
    failure or a bug (SQLite's "no such table") is not."""
    for err in _chain(e):
        if isinstance(err, DatabaseUnavailable):
            return True
        if isinstance(err, DBAPIError) and err.connection_invalidated:
            return True
        if isinstance(err, InterfaceError):
            return True
        if isinstance(err, PendingRollbackError) and "invalid transaction" in str(err).lower():
            return True
        if isinstance(err, DBAPIError) and _sqlstate(err.orig) in _AWAY_SQLSTATES:
            return True  # a read-only server raises InternalError, not OperationalError
        if isinstance(err, OperationalError) and err.orig is not None:
            orig = err.orig
            state = getattr(orig, "sqlstate", None)
            if type(orig).__module__.startswith("psycopg"):
                if state is None or state.startswith("08") or state in _AWAY_SQLSTATES:
                    return True
            elif any(m in str(orig).lower() for m in _SQLITE_AWAY):
                return True
    return False


def ping(sessions: sessionmaker[Session]) -> None:
    """One `SELECT 1`, once (no retry): raises when the database does not answer."""
    with session_scope(sessions) as s:
        s.execute(text("SELECT 1"))


class ReadOnlyError(RuntimeError):
    """A write through a read-only session: only the store writes rows."""


def make_reader(engine: Engine) -> sessionmaker[Session]:
    """Sessions for the read side (the API's GETs, export, plots, Prometheus): any INSERT,
    UPDATE or DELETE through one raises `ReadOnlyError` before it reaches the database."""
    return sessionmaker(engine, expire_on_commit=False, info={"read_only": True})


_WRITES = ("insert", "update", "delete", "merge", "create", "drop", "alter", "truncate", "copy")


@event.listens_for(Session, "do_orm_execute")
def _refuse_dml(state: Any) -> None:
    if not state.session.info.get("read_only"):
        return
    text = str(state.statement).lstrip().lower()
    if state.is_insert or state.is_update or state.is_delete or text.startswith(_WRITES):
        raise ReadOnlyError(f"read-only session: {text[:80]}")


@event.listens_for(Session, "before_flush")
def _refuse_flush(session: Session, _ctx: Any, _instances: Any) -> None:
    if session.info.get("read_only") and (session.new or session.dirty or session.deleted):
        raise ReadOnlyError("read-only session: changed objects would be flushed")
