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
from service.store import (
    EXIT_DATABASE_AWAY,
    Charge,
    Store,
    StudyStatus,
    TrialState,
    optuna_storage,
    utcnow,
)

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

    Each dead job is charged when its study is relaunched (`_charge`): a runner that exited
    because the database was away (EXIT_DATABASE_AWAY) is weather, relaunched no sooner than
    `weather_relaunch_delay_s` after its exit and at most `max_weather_relaunches` times;
    any other death counts against `max_job_attempts`. A study past either bound is marked
    FAILED with the reason instead of being resubmitted forever. A failing database (or
    Ray) never ends the round early for the other studies: each study's step is on its own,
    and whatever failed is tried again next round. Returns how many jobs were submitted.
    Called periodically by the service.
    """
    try:  # closing is never a reason to skip this round's launches
        close_leftovers(store, settings)
    except Exception:
        log.exception("reconcile: closing the trials ended studies left open failed")
    rows = store.studies.live()  # the database does not answer: no round (the caller logs)
    if not rows:
        return 0
    try:  # one look at Ray's job list; if Ray can't answer, nothing is judged dead
        jobs = {j.submission_id: j for j in launcher.list_jobs()}
    except Exception as e:
        log.warning("reconcile: Ray's job list is unavailable (%s); next round", e)
        try:
            store.studies.mark_ray_unreachable(launcher.address, e)
        except Exception as db:
            log.warning("reconcile: saying so on the studies failed: %s", db)
        return 0
    try:
        store.studies.mark_ray_reachable()
    except Exception as e:
        log.warning("reconcile: clearing the Ray reasons failed: %s", e)
    submitted = 0
    for row in rows:
        try:
            submitted += _reconcile_study(store, launcher, settings, row, jobs, grace_s)
        except Exception as e:  # Ray or the database: this study is tried again next round
            log.warning("reconcile: study %s: %s", row[0], e)
    return submitted


def _reconcile_study(
    store: Store,
    launcher: JobLauncher,
    settings: Settings,
    row: Any,
    jobs: dict[str, Any],
    grace_s: float,
) -> int:
    """One live study's step of a round: nothing, a relaunch (1), or giving up."""
    study_id, status, job_id, created_at, attempts, failures, weather = row
    now = utcnow()
    created = created_at if created_at.tzinfo else created_at.replace(tzinfo=UTC)
    age = (now - created).total_seconds()
    if job_id is None and age < grace_s:
        return 0  # the POST that created it is still submitting its job
    job = jobs.get(job_id) if job_id else None
    job_status = str(job.status.value) if job is not None else None
    young = status == StudyStatus.PENDING and grace_s > 0 and age < _in_flight_s(grace_s)
    if young and job_status is None:
        # The POST recorded the job id and is submitting it in a thread of its own: Ray's
        # job list does not show it yet, which is no sign that it was lost. (A job Ray
        # lists as ended was submitted: a standby that died after a POST claimed it.)
        return 0
    if job_status in ALIVE:
        return 0
    if status == StudyStatus.RUNNING and job_status == "SUCCEEDED":
        return 0  # finished between our read and Ray's answer; the row will say so
    charge = _charge(job_id, job)
    if charge == Charge.WEATHER:
        ended_ms = getattr(job, "end_time", None)
        if ended_ms and now.timestamp() * 1000 - ended_ms < settings.weather_relaunch_delay_s * 1e3:
            return 0  # give the database the runner could not reach a while
        if weather >= settings.max_weather_relaunches:
            reason = (
                f"runner job exited {weather + 1} times because the database was away "
                f"(last {job_id}); not resubmitting (QKSCOPE_MAX_WEATHER_RELAUNCHES)"
            )
            give_up(store, settings, study_id, reason)
            return 0
    elif charge == Charge.FAILURE and failures + 1 >= settings.max_job_attempts:
        reason = (
            f"runner job died {failures + 1} times (last {job_id}: {job_status or 'gone'}); "
            "not resubmitting (QKSCOPE_MAX_JOB_ATTEMPTS)"
        )
        give_up(store, settings, study_id, reason)
        return 0
    log.info("study %s: job %s is %s; submitting", study_id, job_id, job_status)
    try:
        launched = launch_study(store, launcher, settings, study_id, attempts, charge)
    except Exception as e:  # Ray unreachable: try again next round
        log.warning("study %s: submit failed: %s", study_id, e)
        return 0
    return 1 if launched else 0


def _charge(job_id: str | None, job: Any) -> Charge | None:
    """What the death of the study's recorded job is charged to: nothing when no job was
    recorded (never submitted, or Ray answered that it never took it), weather when its
    runner exited because the database was away, else a failure (a crash, a lost node,
    a job Ray no longer lists)."""
    if job_id is None:
        return None
    if job is not None and getattr(job, "driver_exit_code", None) == EXIT_DATABASE_AWAY:
        return Charge.WEATHER
    return Charge.FAILURE


def _in_flight_s(grace_s: float) -> float:
    """How long after its creation a PENDING study's job may still be on its way to Ray: one
    request to the job server at most (JOB_SERVER_TIMEOUT_S), after the POST's commit."""
    return max(grace_s, JOB_SERVER_TIMEOUT_S + 5.0)


def give_up(store: Store, settings: Settings, study_id: int, reason: str) -> bool:
    """Mark a study FAILED with `reason` (its runner job died too often); its finished
    trials stay, its open ones end FAILED (ours and Optuna's). Survives a failing database:
    a study that could not be marked is judged again next round, and open trials a failed
    close left are closed by `close_leftovers`. Returns whether the study was marked."""
    log.error("study %s: %s", study_id, reason)
    try:
        store.studies.fail_live(study_id, reason)
    except Exception as e:
        log.warning("study %s: marking it FAILED failed (next round): %s", study_id, e)
        return False
    try:
        storage = optuna_storage(settings.resolved_database_url())
        try:
            store.trials.finish_open(
                study_id, TrialState.FAILED, "study failed: " + reason, storage
            )
        finally:
            storage.engine.dispose()
    except Exception as e:
        log.warning("study %s: closing its trials failed (next round): %s", study_id, e)
    return True


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
