"""Launching a study runner as a Ray job (the reconcile round that relaunches them is in
service/control/reconciler.py).

Side effects follow the database: a study row is committed PENDING first and only then is
its Ray job submitted, so a failed submission leaves a PENDING study for the reconciler to
launch later, never a job without a row. The attempt and its job id are claimed and recorded
in one transaction before the submission (`StudyRows.claim_launch`), and attempt numbers
only go up: the fence (service/store/fence.py) never admits two runners with one attempt.

A submission that raised is not taken for a refusal: the request may have reached Ray and
only its answer been lost (a read timeout, a connection reset after the job was sent). So
Ray is asked for the job by its submission id (`JobLauncher.lookup`): if it has it, the
launch succeeded; if it answers that it has none, the recorded id is cleared (the attempt
stays spent, `StudyRows.forget_unsubmitted`) so the relaunch is not charged as a dead
runner; if it does not answer, the id stays and the reconciler judges it from Ray's job
list in a later round. The claim is never undone.
"""

from __future__ import annotations

import contextlib
import logging
import time

from service.config import Settings
from service.control.ray_cluster import JobLauncher, job_id_for
from service.store import Charge, Store

__all__ = ["LOOKUP_TRIES", "launch_study", "maybe_accepted", "runner_env"]

log = logging.getLogger(__name__)
LOOKUP_TRIES = 3  # answers of "no such job" before a failed submission is taken as refused
LOOKUP_PAUSE_S = 0.5  # between them: a request still being handled by the job server lands


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
    charge: Charge | None = None,
) -> str | None:
    """Claim the study's next attempt (its job id recorded with it), submit that job, and
    return its id.

    With `seen_attempts`, the attempt is claimed only if nobody launched the study since
    the caller looked (another reconciler, an overlapping API process): returns None then.
    `charge` counts the previous job's death in the same transaction (the reconciler's).

    Raises:
        Exception: The submission failed and Ray does not have the job (or did not say):
            the attempt stays claimed; the reconciler launches the next one.
    """
    claimed = store.studies.claim_launch(study_id, seen_attempts, job_id_for, charge)
    if claimed is None:
        return None
    attempt, job_id = claimed
    try:
        launcher.submit_study(study_id, attempt, runner_env(settings), job_id)
    except Exception as e:
        has = _ray_has(launcher, job_id)
        if has:
            log.warning("study %s: submit of %s raised (%s) but Ray has it", study_id, job_id, e)
            return job_id  # accepted; only the answer was lost
        if has is False:  # refused: the relaunch is not charged as a dead runner
            _forget(store, study_id, attempt, job_id)
        raise
    return job_id


def _ray_has(launcher: JobLauncher, job_id: str) -> bool | None:
    """Whether Ray has the job `job_id`: True, False (it answered "no such job" each of
    LOOKUP_TRIES times), or None (it did not answer)."""
    for i in range(LOOKUP_TRIES):
        if i:
            time.sleep(LOOKUP_PAUSE_S)
        try:
            if launcher.lookup(job_id) is not None:
                return True
        except Exception as e:
            log.warning("asking Ray for job %s: %s", job_id, e)
            return None
    return False


def _forget(store: Store, study_id: int, attempt: int, job_id: str) -> None:
    with contextlib.suppress(Exception):  # the reconciler judges the recorded id instead
        store.studies.forget_unsubmitted(study_id, attempt, job_id)


def maybe_accepted(e: BaseException) -> bool:
    """Whether the job server may have accepted a submission that raised `e`: the request
    went out and no answer came back (a read timeout), as opposed to a refusal or a
    connection that never opened. (The standbys' rule, service/control/standby.py: a
    standby whose row is dropped exits by itself; a study's launch asks Ray instead.)"""
    import requests

    if isinstance(e, requests.exceptions.ConnectTimeout | requests.exceptions.ConnectionError):
        return isinstance(e, requests.exceptions.ReadTimeout)
    return isinstance(e, TimeoutError | requests.exceptions.ReadTimeout)
