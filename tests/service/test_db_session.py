"""with_retry: which errors it repeats a unit of database work after, and which it lets out."""

from __future__ import annotations

import optuna
import pytest
from sqlalchemy.exc import OperationalError

from service.db.session import with_retry


def _dropped() -> OperationalError:
    return OperationalError("SELECT 1", {}, Exception("terminating connection"))


def test_optuna_wrapped_dropped_connection_is_retried() -> None:
    calls = []

    def unit() -> str:
        calls.append(1)
        if len(calls) == 1:  # what Optuna's RDB storage raises when the commit's connection dies
            try:
                raise _dropped()
            except OperationalError as e:
                raise optuna.exceptions.StorageInternalError("commit failed") from e
        return "told"

    assert with_retry(unit, "tell", base_s=0.01) == "told"
    assert len(calls) == 2


def test_other_errors_are_not_retried() -> None:
    calls = []

    def unit() -> None:
        calls.append(1)
        raise optuna.exceptions.StorageInternalError("invalid data")  # no database cause

    with pytest.raises(optuna.exceptions.StorageInternalError):
        with_retry(unit, "tell", base_s=0.01)
    assert len(calls) == 1


def test_gives_up_after_the_last_attempt() -> None:
    calls = []

    def unit() -> None:
        calls.append(1)
        raise _dropped()

    with pytest.raises(OperationalError):
        with_retry(unit, "write", attempts=3, base_s=0.01)
    assert len(calls) == 3
