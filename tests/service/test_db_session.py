"""with_retry: which errors it repeats a unit of database work after, and which it lets out."""

from __future__ import annotations

import optuna
import pytest
from sqlalchemy.exc import OperationalError, PendingRollbackError

from service.store.session import with_retry


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


def test_pending_rollback_after_a_dropped_connection_is_retried() -> None:
    """The chain CI met in `study.ask` while every backend was being terminated: the first
    query's connection died (OperationalError); the session's next statement, run while that
    was handled, raised PendingRollbackError; Optuna re-raised it as StorageInternalError."""
    calls = []

    def unit() -> str:
        calls.append(1)
        if len(calls) == 1:
            try:
                try:
                    raise _dropped()
                except OperationalError:  # raised while handling it, as SQLAlchemy does
                    raise PendingRollbackError("Can't reconnect until invalid transaction")  # noqa: B904
            except PendingRollbackError as e:
                raise optuna.exceptions.StorageInternalError("commit failed") from e
        return "asked"

    assert with_retry(unit, "ask", base_s=0.01) == "asked"
    assert len(calls) == 2


def test_an_error_raised_while_handling_another_is_judged_by_both() -> None:
    """A non-database error raised while a non-database error was handled: not retried."""
    calls = []

    def unit() -> None:
        calls.append(1)
        try:
            raise KeyError("x")
        except KeyError:
            raise optuna.exceptions.StorageInternalError("invalid data") from None

    with pytest.raises(optuna.exceptions.StorageInternalError):
        with_retry(unit, "tell", base_s=0.01)
    assert len(calls) == 1


def test_other_errors_are_not_retried() -> None:
    calls = []

    def unit() -> None:
        calls.append(1)
        raise optuna.exceptions.StorageInternalError("invalid data")  # no database cause

    with pytest.raises(optuna.exceptions.StorageInternalError):
        with_retry(unit, "tell", base_s=0.01)
    assert len(calls) == 1


def test_gives_up_after_its_budget() -> None:
    """An error that may pass but does not say the database is away is retried for the
    transient budget, then raised as it is (an outage: test_db_outage.py)."""
    calls = []

    def unit() -> None:
        calls.append(1)
        raise _dropped()

    with pytest.raises(OperationalError):
        with_retry(unit, "write", transient_s=0.1, base_s=0.01, max_s=0.02)
    assert 3 <= len(calls) < 50
