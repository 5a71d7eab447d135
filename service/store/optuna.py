"""Optuna's storage in the study database: the one place it is opened.

Optuna keeps its own tables (`studies`, `trials`, ...) beside ours; it writes them itself
through this storage. The store touches them only to end the RUNNING Optuna trials of a
study whose trials end without a result (a cancel, a study that gave up).
"""

from __future__ import annotations

import time

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState as OptunaState
from sqlalchemy import event
from sqlalchemy.exc import SQLAlchemyError

from service.store.session import normalize_url, sqlite_pragmas

__all__ = ["fail_optuna_trials", "optuna_storage", "optuna_study_name"]


def optuna_study_name(study_id: int) -> str:
    return f"qkscope-{study_id}"


def optuna_storage(url: str, *, create_tables: bool = True) -> optuna.storages.RDBStorage:
    """Optuna's RDBStorage on the study database, with the project's SQLite pragmas."""
    url = normalize_url(url)
    pre_ping = {} if url.startswith("sqlite") else {"pool_pre_ping": True}
    for attempt in range(3):
        try:
            storage = optuna.storages.RDBStorage(
                url, engine_kwargs=pre_ping, skip_table_creation=not create_tables
            )
            break
        except SQLAlchemyError:
            # Two runners starting at once on a fresh database race to create Optuna's
            # tables ("table ... already exists"); the loser finds them on the next try.
            if attempt == 2:
                raise
            time.sleep(0.5 + attempt)
    if url.startswith("sqlite"):  # Optuna's engine gets our WAL and busy timeout too
        event.listen(storage.engine, "connect", sqlite_pragmas)
        storage.engine.dispose()  # reconnect with them
    return storage


def fail_optuna_trials(storage: optuna.storages.BaseStorage, study_id: int, status: str) -> None:
    """Finish the study's RUNNING Optuna trials as FAIL (user attr `qkscope_status`)."""
    try:
        optuna_id = storage.get_study_id_from_name(optuna_study_name(study_id))
    except Exception:  # never launched: Optuna has no such study (or no tables) yet
        return
    for t in storage.get_all_trials(optuna_id, deepcopy=False, states=(OptunaState.RUNNING,)):
        try:
            storage.set_trial_user_attr(t._trial_id, "qkscope_status", status)
            storage.set_trial_state_values(t._trial_id, OptunaState.FAIL)
        except UpdateFinishedTrialError:  # the runner told it first
            continue
