"""Cancelling a study: the API's one cancel path."""

from __future__ import annotations

import optuna

from service.control.ray_cluster import JobLauncher
from service.store import Store, Study, StudyStatus, TrialState, optuna_storage

__all__ = ["cancel_study"]


def cancel_study(
    store: Store,
    launcher: JobLauncher | None,
    study_id: int,
    database_url: str | None = None,
) -> Study | None:
    """Mark the study CANCELLED, stop its Ray job, and cancel its unfinished trials (ours,
    and Optuna's when `database_url` is given). Studies that ended otherwise are left as they
    are; a repeated cancel closes what an interrupted one left open."""
    row, job_id = store.studies.cancel(study_id)
    if row is None or row.status != StudyStatus.CANCELLED:
        return row
    if launcher is not None and job_id:
        launcher.stop(job_id)
    storage = optuna_storage(database_url) if database_url else None
    try:
        store.trials.finish_open(study_id, TrialState.CANCELLED, "study cancelled", storage)
    finally:
        if isinstance(storage, optuna.storages.RDBStorage):
            storage.engine.dispose()
    return store.studies.get(study_id)
