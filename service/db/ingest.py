"""Bulk metric writes: the one path every metric row takes into the database.

Rows are inserted in chunks inside the caller's transaction, so a crash leaves
whole batches or nothing; a primary-key conflict (a replayed report) is a no-op.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.db.models import Metric

__all__ = ["CHUNK_ROWS", "insert_metrics"]

CHUNK_ROWS = 5000


def insert_metrics(session: Session, rows: list[dict[str, Any]]) -> None:
    """Insert metric rows (dicts with Metric's columns); existing keys are skipped."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = pg_insert if dialect == "postgresql" else sqlite_insert
    for i in range(0, len(rows), CHUNK_ROWS):
        session.execute(insert(Metric).on_conflict_do_nothing(), rows[i : i + CHUNK_ROWS])
