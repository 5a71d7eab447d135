"""The Ray Job of one study: `python -m service.runner <study_id>`.

A rerun of the same study (after the job or the cluster died) picks up where the database
says it stopped. The study row records the outcome: COMPLETED, CANCELLED, or FAILED with
the traceback, its open trials then ended FAILED too (ours and Optuna's), so a failed study
leaves nothing open.
"""

from __future__ import annotations

import logging
import sys
import traceback

import optuna
import ray

from service.config import Settings, get_settings
from service.runner.loop import StudyRunner
from service.store.models import StudyStatus, TrialState
from service.store.session import make_engine

__all__ = ["main", "run_study"]


def run_study(study_id: int, settings: Settings | None = None) -> StudyStatus:
    """Run (or resume) one study to its end; the study row records the outcome."""
    settings = settings or get_settings()
    engine = make_engine(settings.resolved_database_url())
    runner = None
    try:
        runner = StudyRunner(study_id, settings, engine)
        return runner.run()
    except ray.exceptions.RayError:
        # The cluster failed, not the study (a lost node or actor, a restarting head): leave
        # it RUNNING; the service's reconciler resubmits it, at most max_job_attempts times.
        # SystemExit and KeyboardInterrupt (a stopped job's SIGTERM) pass through the same way.
        raise
    except Exception as e:
        # A bug in the study (or a database outage past the retries) fails it.
        if runner is not None:
            runner.stop_workers()  # their trials end here: nothing trains on for nobody
            reason = "".join(traceback.format_exception(e))[-4000:]
            if runner.store.studies.fail_live(study_id, reason):
                runner.close_open(TrialState.FAILED, "study failed: " + reason[-500:])
        raise
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m service.runner STUDY_ID", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ray.init(log_to_driver=False)
    status = run_study(int(args[0]))
    print(f"study {args[0]}: {status}")
    return 0 if status != StudyStatus.FAILED else 1
