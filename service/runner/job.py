"""The Ray Job of one study: `python -m service.runner <study_id> [<attempt>]`.

A rerun of the same study (after the job or the cluster died) picks up where the database
says it stopped. The study row records the outcome: COMPLETED, CANCELLED, or FAILED with
the traceback, its open trials then ended FAILED too (ours and Optuna's), so a failed study
leaves nothing open.

A database outage is weather, not a verdict: every unit of database work waits for the
database up to `Settings.db_outage_s` (`outage_window`); if it stays away longer, the runner
stops its workers and exits non-zero (`EXIT_DATABASE_AWAY`) leaving the study RUNNING, and
the reconciler relaunches it once the database answers. The next runner resumes its trials
from their checkpoints and replays their report journals, as after any dead runner.

A runner whose job attempt was superseded by a newer one (two runners for one study)
exits at its next write without touching rows (service/store/fence.py), with exit status 3.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from typing import TYPE_CHECKING

import optuna
import ray

from service.config import Settings, get_settings
from service.runner.loop import StudyRunner
from service.runner.standby import Warm, is_standby, stand_by
from service.store import (
    EXIT_DATABASE_AWAY,
    Fence,
    Store,
    StudyStatus,
    Superseded,
    TrialState,
    database_away,
    make_engine,
    make_sessionmaker,
    outage_window,
    with_retry,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["EXIT_DATABASE_AWAY", "SUPERSEDED_EXIT", "is_weather", "main", "run_study"]

log = logging.getLogger("qkscope.runner")
SUPERSEDED_EXIT = 3  # the job's exit status when a newer attempt of its study took over


def run_study(
    study_id: int, settings: Settings | None = None, attempt: int | None = None
) -> StudyStatus | None:
    """Run (or resume) one study to its end as job attempt `attempt` (None: the study's
    current one); the study row records the outcome. A standby row (service/runner/standby.py)
    is waited on first: None when it was retired before a study claimed it. Raises
    `Superseded` when another attempt took the study over (nothing written, the study left
    to that attempt)."""
    settings = settings or get_settings()
    engine = make_engine(settings.resolved_database_url())
    runner = None
    try:
        with outage_window(settings.db_outage_s):
            warm = None
            standby = Store(make_sessionmaker(engine))  # unfenced: reads, and its heartbeat
            if is_standby(study_id, standby):  # wait for a POST to claim it
                warm = stand_by(study_id, settings, standby)
                if warm is None:
                    return None  # retired before any study claimed it
            runner = _build(study_id, settings, engine, attempt, warm)
            return runner.run()
    except Superseded as e:
        # Another runner owns the study now: stop this one's workers and leave every row
        # (the study is neither FAILED nor done; the current attempt carries on).
        log.warning("%s; exiting", e)
        if runner is not None:
            runner.stop_workers()
        raise
    except ray.exceptions.RayError:
        # The cluster failed, not the study (a lost node or actor, a restarting head): leave
        # it RUNNING; the service's reconciler resubmits it, at most max_job_attempts times.
        # SystemExit and KeyboardInterrupt (a stopped job's SIGTERM) pass through the same way.
        raise
    except Exception as e:
        if database_away(e):
            # The database stayed away past db_outage_s: not the study's fault. Leave it
            # RUNNING (its trials open, ours and Optuna's) for the reconciler to relaunch.
            log.error("study %s: %s; exiting, the study stays RUNNING", study_id, e)
            if runner is not None:
                runner.stop_workers()
            raise
        # A bug in the study fails it.
        if runner is not None:
            runner.stop_workers()  # their trials end here: nothing trains on for nobody
            reason = "".join(traceback.format_exception(e))[-4000:]
            if runner.store.studies.fail_live(study_id, reason):
                runner.close_open(TrialState.FAILED, "study failed: " + reason[-500:])
        raise
    finally:
        engine.dispose()


def _build(
    study_id: int, settings: Settings, engine: Engine, attempt: int | None, warm: Warm | None
) -> StudyRunner:
    """The study's runner. A failure to build it (a stored definition this code refuses, a
    sampler Optuna cannot make, a grid that does not fit in memory) fails the study once,
    with the reason: a relaunch would fail the same way, `QKSCOPE_MAX_JOB_ATTEMPTS` times.
    A database that does not answer or a Ray error is no verdict on the study: it stays as
    it is, for the reconciler to launch again."""
    try:
        return with_retry(
            lambda: StudyRunner(study_id, settings, engine, attempt, warm),
            "start the study's runner",
        )
    except Exception as e:
        if not isinstance(e, Superseded) and not is_weather(e):
            reason = (
                "the study's runner could not be built: "
                + "".join(traceback.format_exception(e))[-4000:]
            )
            log.error("study %d: %s", study_id, reason)
            fence = None if attempt is None else Fence(study_id, attempt)
            with contextlib.suppress(Exception):  # its open trials: the reconciler closes them
                Store(make_sessionmaker(engine), fence).studies.fail_live(study_id, reason)
        raise


def is_weather(e: BaseException) -> bool:
    """Whether `e` says the database or the Ray cluster failed, rather than the study."""
    if database_away(e):
        return True
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, ray.exceptions.RayError):
            return True
        todo.extend(x for x in (err.__cause__, err.__context__) if x is not None)
    return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or not all(a.isdigit() for a in args):
        print("usage: python -m service.runner STUDY_ID [ATTEMPT]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ray.init(log_to_driver=False)
    attempt = int(args[1]) if len(args) == 2 else None
    try:
        status = run_study(int(args[0]), attempt=attempt)
    except Superseded as e:
        print(f"study {args[0]}: superseded ({e})")
        return SUPERSEDED_EXIT
    except Exception as e:
        if not database_away(e):
            raise
        print(f"study {args[0]}: database unreachable, left RUNNING ({e})", file=sys.stderr)
        return EXIT_DATABASE_AWAY
    print(f"study {args[0]}: {status or 'standby retired'}")
    return 0 if status != StudyStatus.FAILED else 1
