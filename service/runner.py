"""The Ray Job entrypoint of one study: `python -m service.runner <study_id>`.

Drives Optuna with ask/tell against RDBStorage in the study's own database. With
`fuse: 1` it keeps `parallelism` Ray tasks in flight, one trial each; with `fuse > 1` it keeps
`parallelism` slot workers of up to `fuse` member slots each, and a slot freed by a member
that stopped takes the next trial at once (service/slots.py). It asks Optuna for a trial
only when a slot is waiting for one. It persists every report in one transaction per batch
(a crash leaves whole batches or nothing; replays are no-ops thanks to the metric primary
key), answers pruning questions, records and tells each outcome the moment it arrives, and
marks the study COMPLETED, FAILED or CANCELLED.

The runner in parts, each readable alone: service/dispatch.py makes trial configs and
single-trial tasks; service/slots.py keeps the slot workers; service/trial_events.py owns
the open trials' event state (starts, reports, pruning); service/finishing.py holds a
finished trial until its last reports are stored; service/outcomes.py records and tells
outcomes; this module asks Optuna, launches, resumes after a crash, cancels and runs
the loop.

A rerun of the same study (after the job or the cluster died) picks up where
the database says it stopped: trials that were running are relaunched with
the same parameters and resume from their checkpoints.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections import deque
from typing import Any

import optuna
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.asking import TrialSource
from service.config import Settings, get_settings
from service.db.models import (
    Study,
    StudyStatus,
    Trial,
    TrialState,
    stored_metric_rows,
    utcnow,
)
from service.db.session import (
    make_engine,
    make_sessionmaker,
    session_scope,
    with_retry,
)
from service.dispatch import Planned, submit, trial_config
from service.finishing import Finishing
from service.outcomes import Outcomes
from service.slots import SlotPool, slot_key
from service.spec import HISTORY_FREE_SAMPLERS, StudySpec
from service.studies import (
    finish_open_trials,
    make_pruner,
    make_sampler,
    optuna_storage,
    optuna_study_name,
)
from service.trial_events import Running, TrialEvents, take_batches
from service.waiting import WaitingReason
from workers.config import TrialConfig
from workers.remote import Finished, TrialInbox

__all__ = ["main", "run_study"]

log = logging.getLogger("qkscope.runner")
POLL_S = 1.0  # how often the loop looks for a cancel when no trial event woke it
TERMINAL = {StudyStatus.COMPLETED, StudyStatus.FAILED, StudyStatus.CANCELLED}


def set_status(
    sessions: sessionmaker[Session], study_id: int, status: StudyStatus, error: str | None = None
) -> None:
    """Move the study to `status`; a terminal status (e.g. a cancel) is never left."""

    def write() -> None:
        with session_scope(sessions) as s:
            row = s.get(Study, study_id)
            assert row is not None
            if StudyStatus(row.status) in TERMINAL:
                return
            row.status = status
            if status == StudyStatus.RUNNING and row.started_at is None:
                row.started_at = utcnow()
            if status in TERMINAL:
                row.finished_at = utcnow()
            if error:
                row.error = error

    with_retry(write, "set status")


def recount_cancelled(sessions: sessionmaker[Session], row_ids: list[int]) -> None:
    """Cancelled here or by the API a moment ago: count the metric rows stored now, after
    the last batch this runner persisted."""
    with session_scope(sessions) as s:
        s.execute(
            update(Trial)
            .where(Trial.id.in_(row_ids), Trial.state == TrialState.CANCELLED)
            .values(metric_rows=stored_metric_rows())
        )


def is_cancelled(sessions: sessionmaker[Session], study_id: int) -> bool:
    def read() -> bool:
        with session_scope(sessions) as s:
            status = s.scalar(select(Study.status).where(Study.id == study_id))
            return bool(status == StudyStatus.CANCELLED)

    return with_retry(read, "read status")


class StudyRunner:
    """One study's control loop. All database and Optuna access happens on this thread."""

    def __init__(self, study_id: int, settings: Settings, engine: Engine) -> None:
        self.study_id, self.settings = study_id, settings
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        with session_scope(self.sessions) as s:
            row = s.get(Study, study_id)
            if row is None:
                raise LookupError(f"study {study_id} not found")
            self.spec = StudySpec.model_validate(row.spec)
            self.status = StudyStatus(row.status)
            # whose checkpoints: a new study with the same id (a reset database) is another
            self.owner = f"study-{study_id}@{row.created_at.isoformat()}"
        self.storage = optuna_storage(settings.resolved_database_url())
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=optuna_study_name(study_id),
            directions=self.spec.directions(),  # type: ignore[arg-type]
            sampler=make_sampler(self.spec),
            pruner=make_pruner(self.spec),
            load_if_exists=True,
        )
        self.events = TrialEvents(self.spec, self.sessions)
        self.outcomes = Outcomes(self.spec, self.study, self.storage, self.sessions, study_id)
        self.tasks: dict[Any, Running] = {}  # fuse 1: a Ray task -> its trial
        self.pool: SlotPool | None = None  # fuse > 1: the slot workers (made with the inbox)
        self.pending: deque[Planned] = deque()  # asked (or handed back), waiting for a slot
        self.finishing = Finishing(self.outcomes, self.events)
        self.source = TrialSource(self.spec, self.study, self.sessions, study_id)
        self.waiting = WaitingReason(self.spec, self.sessions, study_id)

    # ---- asking and launching ------------------------------------------------------------

    def _config(self, p: Planned) -> TrialConfig:
        return trial_config(
            self.spec, self.settings, self.study_id, p.params, p.number, owner=self.owner
        )

    def _room(self) -> int:
        """Trials that could start now: the slots waiting for one."""
        if self.pool is not None:
            return self.pool.room()
        return self.spec.parallelism - len(self.tasks)

    def _launch_pending(self, inbox: Any) -> None:
        """Start waiting trials while slots fit them: in order with one task per trial; with
        slot workers, any waiting trial whose key has a slot (the others keep waiting)."""
        for p in list(self.pending):
            entry = self.events.entry(p.number) or Running(
                trial=p.trial, row_id=p.row_id, number=p.number, started=time.monotonic()
            )
            if self.pool is not None:
                if not self.pool.place(p, self._config(p)):
                    continue
            elif len(self.tasks) < self.spec.parallelism:
                self.tasks[submit(self.spec, self.study_id, p, self._config(p), inbox)] = entry
            else:
                return
            self.pending.remove(p)
            self.events.track(entry)

    def _may_ask(self) -> bool:
        """Whether to ask for another trial now that the waiting ones are placed where they
        fit: only with nothing waiting, except for samplers whose proposals ignore results
        (random, grid), which may look ahead up to `slots x parallelism` trials so that
        workers fill with trials of their own architecture (asking ahead changes nothing
        such a sampler proposes)."""
        if not self.pending:
            return True
        if self.pool is None or self.spec.sampler.kind not in HISTORY_FREE_SAMPLERS:
            return False
        return len(self.pending) < self.spec.slots * self.spec.parallelism

    def _launched(self) -> set[int]:
        return {p.number for p in self.pending} | {e.number for e in self.tasks.values()}

    def _queued_rows(self) -> list[int]:
        """Row ids of trials launched or waiting that have not started anywhere yet."""
        queued = [e.row_id for e in self.tasks.values() if e.starts == 0]
        if self.pool is not None:  # assigned to a slot worker that has not started them
            queued += [
                p.row_id
                for p in self.pool.members()
                if (e := self.events.entry(p.number)) is not None and e.starts == 0
            ]
        return queued + [p.row_id for p in self.pending]

    # ---- results ------------------------------------------------------------------------------

    def _collect(self, ref: Any) -> None:
        """A single-trial task returned (or failed): finish its trial once all its reports
        are stored; a failure fails it (Ray has already used up its retries)."""
        entry = self.tasks.pop(ref)
        try:
            out: dict[str, Any] = ray.get(ref)
        except Exception as e:
            self.finishing.fail(entry, f"{type(e).__name__}: {str(e)[-2000:]}")
            return
        self.finishing.hold(entry, out)

    def _worker_ended(self, ref: Any) -> None:
        """A slot worker's task returned or died. Its members that had not finished go back
        to wait for a slot of their key (each resumes from its own checkpoint), unless a
        member has used up its `max_retries`: it fails with the worker's error."""
        assert self.pool is not None
        worker = self.pool.ended(ref)
        reason = None
        try:
            done = ray.get(ref)
            log.info(
                "%s ended: %d member-steps computed for %d members",
                worker.name,
                int(done.get("steps", 0)),
                int(done.get("members", 0)),
            )
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e)[-2000:]}"
            log.warning("%s ended: %s", worker.name, reason)
        for number, planned in worker.members.items():
            entry = self.events.entry(number)
            if entry is None or number in self.finishing:
                continue
            if reason is not None and entry.starts > self.spec.max_retries:
                self.finishing.fail(entry, reason)
            else:
                self.pending.appendleft(planned)

    def _on_finished(self, finished: list[Finished]) -> None:
        """Slot members' results: the slot is free at once; the outcome is recorded when all
        the member's reports are stored. A trial handed back (no slot for it) waits again; one
        the worker could not train at all (out of memory alone in it) fails."""
        assert self.pool is not None
        for number, result in finished:
            if result.get("returned"):
                planned = self.pool.release(number, slots=int(result.get("slots") or 1))
                if planned is not None:
                    self.pending.appendleft(planned)
                continue
            self.pool.release(number)
            entry = self.events.entry(number)
            if entry is None:
                continue
            if result.get("failed"):
                self.finishing.fail(entry, str(result["failed"]))
            else:
                self.finishing.hold(entry, result)

    # ---- the loop -----------------------------------------------------------------------------

    def _refs(self) -> list[Any]:
        return list(self.tasks) + (self.pool.refs() if self.pool is not None else [])

    def _open_row_ids(self) -> list[int]:
        rows = [e.row_id for e in self.tasks.values()]
        if self.pool is not None:
            rows += [p.row_id for p in self.pool.members()]
        return rows

    def _cancel_all(self) -> None:
        for ref in self._refs():
            ray.cancel(ref, force=True)
        self.finishing.record_all()  # arrived before the cancel: keep it
        row_ids = self._open_row_ids()
        self.tasks.clear()
        if self.pool is not None:
            self.pool.workers.clear()
        self.pending.clear()  # asked, never launched: finish_open_trials closes them below
        with_retry(
            lambda: finish_open_trials(
                self.sessions, self.storage, self.study_id, TrialState.CANCELLED, "study cancelled"
            ),
            "cancel trials",
        )

        with_retry(lambda: recount_cancelled(self.sessions, row_ids), "count cancelled rows")

    def _close_workers(self, more_to_ask: bool) -> None:
        """Slot workers that no trial will come to are told so (they exit when empty): all
        of them once nothing is left to ask; idle ones whose key no waiting trial has (so a
        worker of a waiting trial's key can start in their place)."""
        if self.pool is None:
            return
        if not more_to_ask and not self.pending:
            self.pool.close()
        elif self.pending:
            waiting = {slot_key(self._config(p), p.number)[0] for p in self.pending}
            self.pool.close(keep_keys=waiting, idle_only=True)

    def run(self) -> StudyStatus:
        if self.status in TERMINAL:
            return self.status
        set_status(self.sessions, self.study_id, StudyStatus.RUNNING)
        # The inbox lives on the runner's node: it shares the runner's fate, never a worker's.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        inbox = TrialInbox.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]
        if self.spec.slots > 1:
            self.pool = SlotPool(self.spec, self.study_id, inbox)
        self.pending.extend(self.source.resume_orphans(self.outcomes.tell_recorded))
        t0 = time.monotonic()
        timeout = self.spec.budget.timeout_s
        asked = with_retry(lambda: len(self.study.get_trials(deepcopy=False)), "count trials")
        # One streaming call for the study's whole life: a batch whenever trials reported.
        stream = inbox.stream.options(num_returns="streaming").remote()
        try:
            while True:
                if is_cancelled(self.sessions, self.study_id):
                    self._cancel_all()
                    return StudyStatus.CANCELLED
                out_of_time = timeout is not None and time.monotonic() - t0 > timeout
                self._launch_pending(inbox)
                while (
                    self._may_ask()
                    and self._room() > 0
                    and asked < self.spec.budget.n_trials
                    and not out_of_time
                ):
                    # one trial for one waiting slot (or a look ahead: see _may_ask)
                    self.pending.append(self.source.ask(self._launched))
                    asked += 1
                    self._launch_pending(inbox)
                self._close_workers(asked < self.spec.budget.n_trials and not out_of_time)
                refs = self._refs()
                if not refs and not self.finishing and not self.pending:
                    break
                # Wake when a task ends or trials report, else after POLL_S to look for a cancel.
                ready, _ = ray.wait([*refs, stream], num_returns=1, timeout=POLL_S)
                if refs:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                finished = self.events.on_batches(take_batches(stream), inbox)
                if finished:
                    self._on_finished(finished)
                for ref in ready:
                    if ref in self.tasks:
                        self._collect(ref)
                    else:
                        self._worker_ended(ref)
                self.finishing.record_ready()
                self.waiting.check(self._queued_rows())
        finally:
            inbox.close.remote()
        set_status(self.sessions, self.study_id, StudyStatus.COMPLETED)
        return StudyStatus.COMPLETED


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
            reason = "".join(traceback.format_exception(e))[-4000:]
            set_status(runner.sessions, study_id, StudyStatus.FAILED, reason)
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


if __name__ == "__main__":
    raise SystemExit(main())
