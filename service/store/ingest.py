"""Bulk metric writes: the one path every metric row takes into the database.

Rows go in inside the caller's transaction, so a crash leaves whole batches or
nothing; a primary-key conflict (a replayed report) is a no-op; a non-finite
value is stored as NULL.

PostgreSQL: binary COPY into a session-local staging table, then one plain
`INSERT ... SELECT` under a savepoint; only if that hits a duplicate key (a
replay, rare) is it rolled back to the savepoint and redone as
`INSERT ... SELECT ... ON CONFLICT DO NOTHING`, which skips conflicts but costs
~40% more per row. That is 5-10x faster than multi-row INSERTs and close to a
bare COPY into the table (bench/ingest.py measures both). SQLite: one prepared
`INSERT ... ON CONFLICT DO NOTHING` run with executemany on the driver.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.store.models import NO_INDEX, Metric

__all__ = ["CHUNK_ROWS", "COLUMNS", "insert_metrics"]

CHUNK_ROWS = 5000  # rows per statement on the generic (non-COPY) path
COLUMNS = ("trial_id", "name", "layer", "head", "step", "value")
_COLS = ", ".join(f'"{c}"' for c in COLUMNS)
_STAGE = "qk_metric_stage"
# Session-local (TEMP) and emptied at every commit or rollback, so nothing staged ever
# outlives the transaction that staged it; created once per connection.
_CREATE_STAGE = (
    f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} (trial_id integer, name varchar(64), "
    "layer integer, head integer, step integer, value double precision) ON COMMIT DELETE ROWS"
)
_COPY = f"COPY {_STAGE} ({_COLS}) FROM STDIN (FORMAT BINARY)"
_COPY_TYPES = ["int4", "varchar", "int4", "int4", "int4", "float8"]
_INSERT = f"INSERT INTO qk_metric ({_COLS}) SELECT {_COLS} FROM {_STAGE}"
_MERGE = f"{_INSERT} ON CONFLICT DO NOTHING"
_SAVEPOINT = "qk_ingest"
_SQLITE = f"INSERT INTO qk_metric ({_COLS}) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"


def _tuples(rows: Iterable[dict[str, Any]]) -> Iterable[tuple[Any, ...]]:
    for r in rows:
        v = r.get("value")
        if v is not None:
            v = float(v)
            if not math.isfinite(v):
                v = None
        yield (
            r["trial_id"],
            r["name"],
            r.get("layer", NO_INDEX),
            r.get("head", NO_INDEX),
            r["step"],
            v,
        )


def _insert_postgresql(session: Session, rows: list[dict[str, Any]]) -> int:
    from psycopg.errors import UniqueViolation

    dbapi = session.connection().connection.driver_connection  # psycopg, in our transaction
    assert dbapi is not None
    with dbapi.cursor() as cur:
        cur.execute(_CREATE_STAGE)
        # A second batch in the same transaction must not see the first one's rows.
        cur.execute(f"DELETE FROM {_STAGE}")
        with cur.copy(_COPY) as copy:
            copy.set_types(_COPY_TYPES)
            for t in _tuples(rows):
                copy.write_row(t)
        cur.execute(f"SAVEPOINT {_SAVEPOINT}")
        try:
            cur.execute(_INSERT)
        except UniqueViolation:  # a replayed report: skip what is already stored
            cur.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
            cur.execute(_MERGE)
        inserted = cur.rowcount
        cur.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
    return max(0, int(inserted))


def _insert_sqlite(session: Session, rows: list[dict[str, Any]]) -> int:
    dbapi = session.connection().connection.driver_connection  # sqlite3, in our transaction
    assert dbapi is not None
    cur = dbapi.cursor()
    try:
        cur.executemany(_SQLITE, _tuples(rows))
        return max(0, int(cur.rowcount))
    finally:
        cur.close()


def _insert_generic(session: Session, rows: list[dict[str, Any]]) -> int:
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    clean = [dict(zip(COLUMNS, t, strict=True)) for t in _tuples(rows)]
    for i in range(0, len(clean), CHUNK_ROWS):
        session.execute(insert(Metric).on_conflict_do_nothing(), clean[i : i + CHUNK_ROWS])
    return len(clean)


def insert_metrics(session: Session, rows: list[dict[str, Any]]) -> int:
    """Insert metric rows (dicts with Metric's columns); existing keys are skipped.

    Returns how many rows were new (on SQLite and PostgreSQL; other databases: how many
    were sent). Non-finite values are stored as NULL. Runs in the session's transaction:
    the caller commits (or rolls back) the batch as a whole.
    """
    if not rows:
        return 0
    dialect = session.get_bind().dialect.name
    driver = session.get_bind().dialect.driver
    if dialect == "postgresql" and driver == "psycopg":
        return _insert_postgresql(session, rows)
    if dialect == "sqlite" and driver == "pysqlite":
        return _insert_sqlite(session, rows)
    return _insert_generic(session, rows)
