"""Alembic migrations of qkscope's tables, shipped as the package `qkscope_migrations`."""
