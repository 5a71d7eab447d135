"""Launching study runners as Ray jobs, and the reconciler that keeps them launched.

Side effects follow the database: a study row is committed PENDING first and only then is
its Ray job submitted, so a failed submission leaves a PENDING study for the reconciler to
launch later, never a job without a row. The job id is chosen here and recorded before the
submission, so a submission that Ray accepted but whose answer was lost (a client timeout)
is found by that id, not submitted a second time.
"""

from __future__ import annotations

import logging
from datetime import UTC

from service.config import Settings
from service.control.ray_cluster import JOB_SERVER_TIMEOUT_S, JobLauncher, job_id_for
from service.store import Store, StudyStatus, TrialState, optuna_storage, utcnow

__all__ = ["close_leftovers", "launch_study", "maybe_accepted", "reconcile", "runner_env"]

log = logging.getLogger(__name__)
ALIVE = ("PENDING", "RUNNING")


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


def reconcile(
    store: Store, launcher: JobLauncher, settings: Settings, grace_s: float = 15.0
) -> int:
    """Launch PENDING studies and relaunch RUNNING ones whose Ray job is gone or dead; close
    the trials that ended studies left open (`close_leftovers`).

    A study whose runner job has died `settings.max_job_attempts` times is marked FAILED
    with the last job status instead of being resubmitted forever. Returns how many jobs
    were submitted. Called periodically by the service.
    """
    try:  # closing is never a reason to skip this round's launches
        close_leftovers(store, settings)
    except Exception:
        log.exception("reconcile: closing the trials ended studies left open failed")
    rows = store.studies.live()
    if not rows:
        return 0
    try:  # one look at Ray's job list; if Ray can't answer, nothing is judged dead
        jobs = {j.submission_id: str(j.status.value) for j in launcher.list_jobs()}
    except Exception as e:
        log.warning("reconcile: Ray's job list is unavailable (%s); next round", e)
        store.studies.mark_ray_unreachable(launcher.address, e)
        return 0
    store.studies.mark_ray_reachable()
    submitted = 0
    now = utcnow()
    for study_id, status, job_id, created_at, attempts in rows:
        created = created_at if created_at.tzinfo else created_at.replace(tzinfo=UTC)
        age = (now - created).total_seconds()
        if job_id is None and age < grace_s:
            continue  # the POST that created it is still submitting its job
        job_status = jobs.get(job_id) if job_id else None
        young = status == StudyStatus.PENDING and grace_s > 0 and age < _in_flight_s(grace_s)
        if young and job_status is None:
            # The POST recorded the job id and is submitting it in a thread of its own: Ray's
            # job list does not show it yet, which is no sign that it was lost. (A job Ray
            # lists as ended was submitted: a standby that died after a POST claimed it.)
            continue
        if job_status in ALIVE:
            continue
        if status == StudyStatus.RUNNING and job_status == "SUCCEEDED":
            continue  # finished between our read and Ray's answer; the row will say so
        if attempts >= settings.max_job_attempts:
            give_up(store, settings, study_id, job_id, job_status, attempts)
            continue
        log.info("study %s: job %s is %s; submitting", study_id, job_id, job_status)
        try:
            if launch_study(store, launcher, settings, study_id, seen_attempts=attempts):
                submitted += 1
        except Exception as e:  # Ray unreachable: try again next round
            log.warning("study %s: submit failed: %s", study_id, e)
    return submitted


def _in_flight_s(grace_s: float) -> float:
    """How long after its creation a PENDING study's job may still be on its way to Ray: one
    request to the job server at most (JOB_SERVER_TIMEOUT_S), after the POST's commit."""
    return max(grace_s, JOB_SERVER_TIMEOUT_S + 5.0)


def give_up(
    store: Store,
    settings: Settings,
    study_id: int,
    job_id: str | None,
    job_status: str | None,
    attempts: int,
) -> None:
    """Mark a study FAILED after its runner job died too often; its finished trials stay,
    its open ones end FAILED (ours and Optuna's)."""
    reason = (
        f"runner job died {attempts} times (last {job_id}: {job_status or 'gone'}); "
        "not resubmitting (QKSCOPE_MAX_JOB_ATTEMPTS)"
    )
    log.error("study %s: %s", study_id, reason)
    store.studies.fail_live(study_id, reason)
    storage = optuna_storage(settings.resolved_database_url())
    try:
        store.trials.finish_open(study_id, TrialState.FAILED, "study failed: " + reason, storage)
    finally:
        storage.engine.dispose()


def close_leftovers(store: Store, settings: Settings) -> int:
    """End the QUEUED/RUNNING trials (ours and Optuna's) of studies that are FAILED or
    CANCELLED: a runner that failed could not end them itself, a cancel can be cut off half
    way, and a close whose Optuna step failed left Optuna's RUNNING (found again next round,
    `ended_with_open_trials`). A study whose close fails is logged and retried next round;
    the others are still closed. Returns how many studies it found."""
    leftovers = store.studies.ended_with_open_trials()
    if not leftovers:
        return 0
    storage = optuna_storage(settings.resolved_database_url())
    try:
        for study_id, status, error in leftovers:
            if status == StudyStatus.CANCELLED:
                state, reason = TrialState.CANCELLED, "study cancelled"
            else:
                state, reason = TrialState.FAILED, f"study failed: {(error or '').strip()[:200]}"
            try:  # one study's failure never keeps the others open (the next round retries)
                n = store.trials.finish_open(study_id, state, reason, storage)
            except Exception:
                log.exception("study %s is %s: closing its open trials failed", study_id, status)
                continue
            log.warning("study %s is %s: closed %d trials it left open", study_id, status, n)
    finally:
        storage.engine.dispose()
    return len(leftovers)
