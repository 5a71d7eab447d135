"""The service fixtures (one app per database module, SQLite and PostgreSQL) for the client."""

from tests.service.conftest import app_settings, client, engine  # noqa: F401
