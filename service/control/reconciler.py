"""The API process's background control loop and its round: launch PENDING studies, relaunch
RUNNING ones whose Ray job died, give up on a study whose job died too often, close the trials
ended studies left open, then keep the standby runners (service/control/standby.py). The Ray
job client is connected lazily (`LauncherSlot`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import UTC
from typing import Any

from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.control.launch import launch_study
from service.control.ray_cluster import JOB_SERVER_TIMEOUT_S, JobLauncher
from service.control.standby import keep_standbys
from service.store import Store, StudyStatus, TrialState, optuna_storage, utcnow

__all__ = ["LauncherSlot", "close_leftovers", "give_up", "reconcile", "reconcile_forever"]

log = logging.getLogger("qkscope.app")
ALIVE = ("PENDING", "RUNNING")


class LauncherSlot:
    """Connects to Ray's job server on first use; retries at most every few seconds."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._launcher: JobLauncher | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> JobLauncher | None:
        if not self.address:
            return None
        with self._lock:
            if self._launcher is None and time.monotonic() >= self._next_try:
                try:
                    self._launcher = JobLauncher(self.address)
                except Exception as e:
                    log.warning("Ray job server at %s unreachable: %s", self.address, e)
                    self._next_try = time.monotonic() + 5.0
            return self._launcher


async def reconcile_forever(
    store: Store, slot: LauncherSlot, settings: Settings, rounds: Any
) -> None:
    """Every `reconcile_interval_s`: launch PENDING studies and relaunch RUNNING ones whose
    Ray job died; say on live studies when Ray's job server does not answer. `rounds`
    (a Prometheus counter) counts the rounds: observable proof the loop runs."""
    while True:
        launcher = await run_in_threadpool(slot)
        if launcher is None and settings.ray_address:
            try:  # no job client yet: Ray's job server has not answered since we started
                await run_in_threadpool(
                    store.studies.mark_ray_unreachable, settings.ray_address, "no connection"
                )
            except Exception:
                log.exception("marking studies as waiting for Ray failed")
        if launcher is not None:
            try:
                await run_in_threadpool(reconcile, store, launcher, settings)
            except Exception:
                log.exception("reconcile failed")
            try:
                await run_in_threadpool(keep_standbys, store, launcher, settings)
            except Exception:
                log.exception("keeping standby runners failed")
        rounds.inc()
        await asyncio.sleep(settings.reconcile_interval_s)


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
