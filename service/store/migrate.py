"""`qkscope db upgrade`: apply Alembic migrations (our tables only).

The migrations live in the repository's `migrations/` directory, which the wheel ships as
the package `qkscope_migrations`; an installed qkscope finds them through
importlib.resources, a source checkout (run without installing) next to the source tree.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from alembic import command
from alembic.config import Config

__all__ = ["alembic_config", "migrations_dir", "upgrade"]

_SOURCE_TREE = Path(__file__).resolve().parents[2] / "migrations"


def migrations_dir() -> Path:
    """Where Alembic's env.py and versions/ are."""
    try:
        found = Path(str(importlib.resources.files("qkscope_migrations")))
    except ModuleNotFoundError:
        return _SOURCE_TREE
    return found if (found / "env.py").is_file() else _SOURCE_TREE


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the schema to `revision`; safe to run on every start."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)
