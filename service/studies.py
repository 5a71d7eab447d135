"""Study lifecycle shared by the API, the CLI and the runner: create, launch, cancel.

Side effects follow the database: a study row is committed PENDING first and
only then is its Ray job submitted, so a failed submission leaves a PENDING
study for the reconciler to launch later, never a job without a row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC
from typing import Any

import optuna
from sqlalchemy import event, or_, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.db.models import (
    OPEN_TRIAL_STATES,
    Study,
    StudyStatus,
    Trial,
    TrialState,
    stored_metric_rows,
    utcnow,
)
from service.db.session import normalize_url, session_scope, sqlite_pragmas
from service.ray_cluster import JobLauncher
from service.spec import StudySpec

__all__ = [
    "cancel_study",
    "finish_open_trials",
    "optuna_storage",
    "create_study",
    "launch_study",
    "mark_ray_reachable",
    "mark_ray_unreachable",
    "make_pruner",
    "make_sampler",
    "optuna_study_name",
    "reconcile",
]

log = logging.getLogger(__name__)
LIVE = (StudyStatus.PENDING, StudyStatus.RUNNING)
# Starts every waiting_reason written while Ray's job server does not answer, so that the
# reason is cleared once it answers again without touching the runner's own reasons
# ("no alive node has ...").
RAY_UNREACHABLE = "Ray cluster unreachable"


def _first_line(e: object, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


def mark_ray_unreachable(
    sessions: sessionmaker[Session],
    address: str,
    error: object,
    study_id: int | None = None,
) -> int:
    """Say on live studies (or just `study_id`) that Ray's job server at `address` does
    not answer, instead of a silent PENDING. A reason the runner wrote is kept. Returns how
    many studies now carry it."""
    reason = (
        f"{RAY_UNREACHABLE}: the job server at {address} does not answer "
        f"({_first_line(error)}); the study starts once it does"
    )
    q = update(Study).where(
        Study.status.in_(LIVE),
        or_(Study.waiting_reason.is_(None), Study.waiting_reason.startswith(RAY_UNREACHABLE)),
    )
    if study_id is not None:
        q = q.where(Study.id == study_id)
    with session_scope(sessions) as s:
        n = s.execute(q.values(waiting_reason=reason)).rowcount  # type: ignore[attr-defined]
    return int(n or 0)


def mark_ray_reachable(sessions: sessionmaker[Session], study_id: int | None = None) -> None:
    """Clear the reasons `mark_ray_unreachable` wrote (Ray answers again)."""
    q = update(Study).where(Study.waiting_reason.startswith(RAY_UNREACHABLE))
    if study_id is not None:
        q = q.where(Study.id == study_id)
    with session_scope(sessions) as s:
        s.execute(q.values(waiting_reason=None))


def optuna_study_name(study_id: int) -> str:
    return f"qkscope-{study_id}"


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler for ask/tell. Optuna's calls `study.stop()` once the grid is used up,
    which raises outside `optimize()`; here the study's budget ends the study instead."""

    def after_trial(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        state: optuna.trial.TrialState,
        values: Sequence[float] | None,
    ) -> None:
        return None


def make_sampler(spec: StudySpec) -> optuna.samplers.BaseSampler:
    """The spec's sampler. Constraints reach it through `Trial.set_constraint` (Optuna 5)."""
    s = spec.sampler
    if s.kind == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if s.kind == "grid":
        grid: dict[str, Any] = {}
        for path, p in spec.search_space.items():
            if p.type == "categorical":
                grid[path] = p.choices
            elif p.type in ("float", "int"):
                grid[path] = p.grid
        return _AskTellGridSampler(grid, seed=s.seed)
    if s.kind == "tpe":
        return optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=s.n_startup_trials)
    if s.kind == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=s.seed, n_startup_trials=s.n_startup_trials)
    if s.kind == "gp":
        return optuna.samplers.GPSampler(seed=s.seed, n_startup_trials=s.n_startup_trials)
    return optuna.samplers.NSGAIISampler(seed=s.seed)


def make_pruner(spec: StudySpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    if p.kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=p.n_startup_trials, n_warmup_steps=p.n_warmup_steps
        )
    if p.kind == "percentile":
        return optuna.pruners.PercentilePruner(
            p.percentile, n_startup_trials=p.n_startup_trials, n_warmup_steps=p.n_warmup_steps
        )
    if p.kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, spec.base.eval_every))
    return optuna.pruners.NopPruner()


def create_study(
    sessions: sessionmaker[Session], spec: StudySpec, idempotency_key: str | None = None
) -> tuple[Study, bool]:
    """Insert a PENDING study (or return the one with the same idempotency key).

    Two concurrent POSTs with one new key race on the unique index: the loser
    reads the winner's row instead of failing.
    """
    try:
        return _insert_study(sessions, spec, idempotency_key)
    except IntegrityError:
        if not idempotency_key:
            raise
        with session_scope(sessions) as s:
            row = s.scalars(select(Study).where(Study.idempotency_key == idempotency_key)).one()
            return row, False


def _insert_study(
    sessions: sessionmaker[Session], spec: StudySpec, idempotency_key: str | None
) -> tuple[Study, bool]:
    with session_scope(sessions) as s:
        if idempotency_key:
            existing = s.scalars(
                select(Study).where(Study.idempotency_key == idempotency_key)
            ).one_or_none()
            if existing is not None:
                return existing, False
        row = Study(
            name=spec.name,
            status=StudyStatus.PENDING,
            spec=spec.model_dump(mode="json", by_alias=True),
            n_trials=spec.budget.n_trials,
            optuna_study_name="",
            idempotency_key=idempotency_key,
        )
        s.add(row)
        s.flush()
        row.optuna_study_name = optuna_study_name(row.id)
        return row, True


def runner_env(settings: Settings) -> dict[str, str]:
    """What the study's Ray job needs to find the database, data and checkpoints.

    Never the database URL itself: a job's runtime_env is shown by Ray's jobs API (and the
    dashboard) to every holder of the Ray token. The runner reads the URL from a file or
    from its node's environment (`Settings.runner_database_url_file`).
    """
    env = {"QKSCOPE_CHECKPOINT_DIR": settings.resolved_checkpoint_dir()}
    if url_file := settings.runner_database_url_file():
        env["QKSCOPE_DATABASE_URL_FILE"] = url_file
    if settings.data_dir:
        env["QKSCOPE_DATA_DIR"] = settings.data_dir
    return env


def launch_study(
    sessions: sessionmaker[Session],
    launcher: JobLauncher,
    settings: Settings,
    study_id: int,
    seen_attempts: int | None = None,
) -> str | None:
    """Submit the study's Ray job (a new attempt id each time) and record it.

    With `seen_attempts`, the attempt is claimed only if nobody launched the study since
    the caller looked (another reconciler, an overlapping API process): returns None then.
    """
    with session_scope(sessions) as s:
        claim = update(Study).where(Study.id == study_id, Study.status.in_(LIVE))
        if seen_attempts is not None:
            claim = claim.where(Study.job_attempts == seen_attempts)
        claimed = s.execute(claim.values(job_attempts=Study.job_attempts + 1))
        if claimed.rowcount != 1:  # type: ignore[attr-defined]
            return None
        attempt = int(s.scalar(select(Study.job_attempts).where(Study.id == study_id)) or 0)
    try:
        job_id = launcher.submit_study(study_id, attempt, runner_env(settings))
    except Exception:  # not submitted: it must not count against max_job_attempts
        with session_scope(sessions) as s:
            s.execute(
                update(Study)
                .where(Study.id == study_id)
                .values(job_attempts=Study.job_attempts - 1)
            )
        raise
    with session_scope(sessions) as s:
        row = s.get(Study, study_id)
        assert row is not None
        row.ray_job_id = job_id
    return job_id


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


def finish_open_trials(
    sessions: sessionmaker[Session],
    storage: optuna.storages.BaseStorage | None,
    study_id: int,
    state: TrialState,
    reason: str,
) -> int:
    """The one way a study's unfinished trials end without a result (cancel, give up).

    Our QUEUED/RUNNING rows become `state` with `reason`, and the study's RUNNING trials in
    Optuna's storage are finished as FAIL (user attr `qkscope_status`), so a runner job that
    died before it saw the cancel leaves no Optuna trial RUNNING for good. Trials that
    finished meanwhile keep their result in both. Returns how many rows were closed.
    """
    with session_scope(sessions) as s:
        closed = s.execute(
            update(Trial)
            .where(Trial.study_id == study_id, Trial.state.in_(OPEN_TRIAL_STATES))
            .values(
                state=state,
                finished_at=utcnow(),
                error=reason,
                waiting_reason=None,
                metric_rows=stored_metric_rows(),
            )
        ).rowcount  # type: ignore[attr-defined]
    if storage is not None:
        _fail_optuna_trials(storage, study_id, state.value.lower())
    return int(closed or 0)


def _fail_optuna_trials(storage: optuna.storages.BaseStorage, study_id: int, status: str) -> None:
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState as OptunaState

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


def cancel_study(
    sessions: sessionmaker[Session],
    launcher: JobLauncher | None,
    study_id: int,
    database_url: str | None = None,
) -> Study | None:
    """Mark the study CANCELLED, stop its Ray job, and cancel its unfinished trials (ours and
    Optuna's, through `finish_open_trials`; Optuna's when `database_url` is given)."""
    with session_scope(sessions) as s:
        row = s.get(Study, study_id)
        if row is None:
            return None
        if row.status in (StudyStatus.COMPLETED, StudyStatus.FAILED, StudyStatus.CANCELLED):
            return row
        row.status, row.finished_at = StudyStatus.CANCELLED, utcnow()
        row.waiting_reason = None
        job_id = row.ray_job_id
    if launcher is not None and job_id:
        launcher.stop(job_id)
    storage = optuna_storage(database_url) if database_url else None
    try:
        finish_open_trials(sessions, storage, study_id, TrialState.CANCELLED, "study cancelled")
    finally:
        if isinstance(storage, optuna.storages.RDBStorage):
            storage.engine.dispose()
    with session_scope(sessions) as s:
        row = s.get(Study, study_id)
    return row


def reconcile(
    sessions: sessionmaker[Session],
    launcher: JobLauncher,
    settings: Settings,
    grace_s: float = 15.0,
) -> int:
    """Launch PENDING studies and relaunch RUNNING ones whose Ray job is gone or dead.

    A study whose runner job has died `settings.max_job_attempts` times is marked
    FAILED with the last job status instead of being resubmitted forever.
    Returns how many jobs were submitted. Called periodically by the service.
    """
    with session_scope(sessions) as s:
        rows = s.execute(
            select(
                Study.id, Study.status, Study.ray_job_id, Study.created_at, Study.job_attempts
            ).where(Study.status.in_(LIVE))
        ).all()
    if not rows:
        return 0
    try:  # one look at Ray's job list; if Ray can't answer, nothing is judged dead
        jobs = {j.submission_id: str(j.status.value) for j in launcher.list_jobs()}
    except Exception as e:
        log.warning("reconcile: Ray's job list is unavailable (%s); next round", e)
        mark_ray_unreachable(sessions, launcher.address, e)
        return 0
    mark_ray_reachable(sessions)
    submitted = 0
    now = utcnow()
    for study_id, status, job_id, created_at, attempts in rows:
        created = created_at if created_at.tzinfo else created_at.replace(tzinfo=UTC)
        if job_id is None and (now - created).total_seconds() < grace_s:
            continue  # the POST that created it is still submitting its job
        job_status = jobs.get(job_id) if job_id else None
        alive = job_status in ("PENDING", "RUNNING")
        if alive:
            continue
        if status == StudyStatus.RUNNING and job_status == "SUCCEEDED":
            continue  # finished between our read and Ray's answer; the row will say so
        if attempts >= settings.max_job_attempts:
            _give_up(sessions, settings, study_id, job_id, job_status, attempts)
            continue
        log.info("study %s: job %s is %s; submitting", study_id, job_id, job_status)
        try:
            if launch_study(sessions, launcher, settings, study_id, seen_attempts=attempts):
                submitted += 1
        except Exception as e:  # Ray unreachable: try again next round
            log.warning("study %s: submit failed: %s", study_id, e)
    return submitted


def _give_up(
    sessions: sessionmaker[Session],
    settings: Settings,
    study_id: int,
    job_id: str | None,
    job_status: str | None,
    attempts: int,
) -> None:
    """Mark a study FAILED after its runner job died too often; its finished trials stay."""
    reason = (
        f"runner job died {attempts} times (last {job_id}: {job_status or 'gone'}); "
        "not resubmitting (QKSCOPE_MAX_JOB_ATTEMPTS)"
    )
    log.error("study %s: %s", study_id, reason)
    with session_scope(sessions) as s:
        s.execute(
            update(Study)
            .where(Study.id == study_id, Study.status.in_(LIVE))
            .values(status=StudyStatus.FAILED, finished_at=utcnow(), error=reason)
        )
    storage = optuna_storage(settings.resolved_database_url())
    try:
        finish_open_trials(
            sessions, storage, study_id, TrialState.FAILED, "study failed: " + reason
        )
    finally:
        storage.engine.dispose()
