"""Keeping standby runners: a runner job started ahead of the next POST.

A cold study waits 5 to 8 s on a small machine for its first training step: Ray starts a
job, its driver imports the runner, a worker process starts and imports torch. A standby
(service/runner/standby.py) has done all that before anyone asks; a POST claims its row
(service/store/standbys.py) and the study's first step comes about a second later.

The reconciler's loop calls `keep_standbys` every round, after `reconcile`:

- a standby whose job is gone or ended is deleted (a POST never claims it: its heartbeat
  stopped);
- while no study is live, standbys are started up to `QKSCOPE_STANDBY`; never while a study
  runs, because a standby's start costs a few CPU-seconds (a driver, torch's import in each
  warm worker) that a small machine would take from the running trials;
- more standbys than asked for (the setting was lowered, two API processes raced) are
  retired, the newest first.

`retire_standbys` deletes every standby row when the API process stops; each standby's
runner sees its row gone within `POLL_S` and its job ends.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from service.config import Settings
from service.control.launch import maybe_accepted, runner_env
from service.control.ray_cluster import JobLauncher, job_id_for
from service.store import StandbyRow, Store, utcnow

__all__ = ["keep_standbys", "retire_standbys"]

log = logging.getLogger(__name__)
ALIVE = ("PENDING", "RUNNING")


def keep_standbys(
    store: Store, launcher: JobLauncher, settings: Settings, grace_s: float = 15.0
) -> int:
    """Drop dead standbys, retire extra ones, and start new ones while no study is live.
    Returns how many were started. Called by the reconciler's loop, after `reconcile`."""
    rows = store.standbys.listed()
    if not rows and settings.standby == 0:
        return 0
    try:  # if Ray can't answer, nothing is judged dead and nothing is started
        jobs = {j.submission_id: str(j.status.value) for j in launcher.list_jobs()}
    except Exception as e:
        log.warning("standbys: Ray's job list is unavailable (%s); next round", e)
        return 0
    now = utcnow()
    alive: list[StandbyRow] = []
    for row in rows:
        study_id, job_id, created, _beat = row
        age = (now - _aware(created)).total_seconds()
        if job_id is not None and (jobs.get(job_id) in ALIVE or age < grace_s):
            alive.append(row)  # running, or submitted too recently to be in Ray's list
            continue
        if store.standbys.drop(study_id):
            log.info("standby %d: job %s is %s; dropped", study_id, job_id, jobs.get(job_id or ""))
    for study_id, *_ in alive[settings.standby :][::-1]:
        store.standbys.drop(study_id)  # its runner sees the row gone and exits
        log.info("standby %d: retired (QKSCOPE_STANDBY=%d)", study_id, settings.standby)
    started = 0
    if len(alive) < settings.standby and not store.studies.live():
        for _ in range(settings.standby - len(alive)):
            if start_standby(store, launcher, settings) is None:
                break
            started += 1
    return started


def start_standby(store: Store, launcher: JobLauncher, settings: Settings) -> int | None:
    """Reserve a study id and submit its runner job (the job a launch of that id would
    submit); returns the id, or None when Ray refused (the row is dropped again)."""
    study_id, job_id = store.standbys.add(job_id_for)
    try:
        launcher.submit_study(study_id, 1, runner_env(settings), job_id)
    except Exception as e:
        if not maybe_accepted(e):
            store.standbys.drop(study_id)
        log.warning("standby %d: submit failed: %s", study_id, e)
        return None
    log.info("standby %d: started (job %s)", study_id, job_id)
    return study_id


def retire_standbys(store: Store) -> int:
    """Delete every standby row (the API process is stopping); returns how many."""
    return sum(store.standbys.drop(study_id) for study_id, *_ in store.standbys.listed())


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)
