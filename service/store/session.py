"""Engines and sessions: the one place a database connection is made."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import InterfaceError, OperationalError, PendingRollbackError
from sqlalchemy.orm import Session, sessionmaker

__all__ = [
    "ReadOnlyError",
    "make_engine",
    "make_reader",
    "make_sessionmaker",
    "normalize_url",
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
    return create_engine(normalize_url(url), pool_pre_ping=True, pool_size=10, max_overflow=20)


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


def with_retry(
    fn: Callable[[], T], what: str, *, attempts: int = 8, base_s: float = 0.25, max_s: float = 8.0
) -> T:
    """Run one unit of database work, again after a dropped connection or a locked database.

    Backs off exponentially (0.25 s, 0.5 s, ... capped at `max_s`; about 24 s in all by
    default). The unit must be safe to repeat: a whole transaction, or an idempotent call.
    """
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:
            cause = _connection_error(e)
            if cause is None or i == attempts - 1:
                raise
            delay = min(max_s, base_s * 2**i)
            log.warning("%s: database error (%s); retry %d in %.2fs", what, cause, i + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _connection_error(e: BaseException) -> BaseException | None:
    """The dropped-connection or locked-database error behind `e`, if there is one.

    Optuna's RDB storage re-raises these as its own StorageInternalError (`raise ... from e`),
    and a dropped connection can surface one step later as SQLAlchemy's PendingRollbackError
    (the session's transaction is invalid; Optuna and `session_scope` roll it back), raised
    while the OperationalError was being handled. So both chains, `__cause__` and
    `__context__`, are searched.
    """
    todo: list[BaseException] = [e]
    seen: set[int] = set()
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OperationalError | InterfaceError):
            return err.orig if err.orig is not None else err
        if isinstance(err, PendingRollbackError):
            return err
        todo.extend(x for x in (err.__cause__, err.__context__) if x is not None)
    return None


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
