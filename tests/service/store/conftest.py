"""Fixtures of the store's tests: a migrated database of each kind and its writers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from service.store import Store, migrate
from service.store.session import make_engine, make_sessionmaker


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    migrate.upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def store(engine: Engine) -> Store:
    return Store(make_sessionmaker(engine))
