"""Launching a study runner as a Ray job (the reconcile round that relaunches them is in
service/control/reconciler.py).

Side effects follow the database: a study row is committed PENDING first and only then is
its Ray job submitted, so a failed submission leaves a PENDING study for the reconciler to
launch later, never a job without a row. The job id is chosen here and recorded before the
submission, so a submission that Ray accepted but whose answer was lost (a client timeout)
is found by that id, not submitted a second time.
"""

from __future__ import annotations

import logging

from service.config import Settings
from service.control.ray_cluster import JobLauncher, job_id_for
from service.store import Store

__all__ = ["launch_study", "maybe_accepted", "runner_env"]

log = logging.getLogger(__name__)


def runner_env(settings: Settings) -> dict[str, str]:
    """What the study's Ray job needs to find the database, data and checkpoints.

    Never the database URL itself: a job's runtime_env is shown by Ray's jobs API (and the
    dashboard) to every holder of the Ray token. The runner reads the URL from a file or
    from its node's environment (`Settings.runner_database_url_file`).
    """
    env = {
        "QKSCOPE_CHECKPOINT_DIR": settings.resolved_checkpoint_dir(),
        "QKSCOPE_DB_OUTAGE_S": str(settings.db_outage_s),
    }
    if url_file := settings.runner_database_url_file():
        env["QKSCOPE_DATABASE_URL_FILE"] = url_file
    if settings.data_dir:
        env["QKSCOPE_DATA_DIR"] = settings.data_dir
    return env


def launch_study(
    store: Store,
    launcher: JobLauncher,
    settings: Settings,
    study_id: int,
    seen_attempts: int | None = None,
) -> str | None:
    """Submit the study's Ray job (a new attempt id each time) and record it.

    With `seen_attempts`, the attempt is claimed only if nobody launched the study since
    the caller looked (another reconciler, an overlapping API process): returns None then.
    """
    previous = store.studies.get(study_id)
    attempt = store.studies.claim_launch(study_id, seen_attempts)
    if attempt is None:
        return None
    job_id = job_id_for(study_id, attempt)
    store.studies.record_job(study_id, job_id)
    try:
        launcher.submit_study(study_id, attempt, runner_env(settings), job_id)
    except Exception as e:
        if not maybe_accepted(e):  # refused: it must not count against max_job_attempts
            store.studies.unclaim_launch(study_id, previous.ray_job_id if previous else None)
        raise  # else Ray may have accepted it: the recorded id finds it in the next round
    return job_id


def maybe_accepted(e: BaseException) -> bool:
    """Whether the job server may have accepted a submission that raised `e`: the request
    went out and no answer came back (a read timeout), as opposed to a refusal or a
    connection that never opened."""
    import requests

    if isinstance(e, requests.exceptions.ConnectTimeout | requests.exceptions.ConnectionError):
        return isinstance(e, requests.exceptions.ReadTimeout)
    return isinstance(e, TimeoutError | requests.exceptions.ReadTimeout)
