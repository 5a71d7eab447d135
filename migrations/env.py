"""Alembic environment: qkscope's `qk_` tables only, never Optuna's."""

from __future__ import annotations

from typing import Any

from alembic import context

from service.store import Base, make_engine

VERSION_TABLE = "qkscope_alembic_version"


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """Leave every table that is not ours (Optuna's `studies`, `trials`, ...) alone."""
    if type_ == "table":
        return bool(name and name.startswith("qk_"))
    table = getattr(obj, "table", None)
    if table is not None:
        return bool(table.name.startswith("qk_"))
    return True


def run_migrations() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.connect() as conn:
            _run(conn)
        engine.dispose()
    else:
        _run(connection)


def _run(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        include_object=include_object,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
