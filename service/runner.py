"""The Ray Job entrypoint of one study: `python -m service.runner <study_id>`.

Drives Optuna with ask/tell against RDBStorage in the study's own database,
keeps `parallelism` Ray tasks in flight (one trial each, or a fused group of up to
`fuse` trials each: see service/dispatch.py),
persists every report in one transaction per batch (a crash leaves whole
batches or nothing; replays are no-ops thanks to the metric primary key),
answers pruning questions, tells Optuna each result, and marks the study
COMPLETED, FAILED or CANCELLED.

The runner in parts, each readable alone: service/dispatch.py turns asked trials into
(fused) groups and Ray tasks; service/trial_events.py stores the inbox's starts and reports
and decides pruning; this module asks and tells Optuna, finishes, fails and cancels trials,
resumes after a crash, and runs the loop.

A rerun of the same study (after the job or the cluster died) picks up where
the database says it stopped: trials that were running are relaunched with
the same parameters and resume from their checkpoints.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import optuna
import ray
from optuna.trial import TrialState as OptunaState
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings, get_settings
from service.db.models import (
    CURRENT_PENALTY_VERSION,
    OPEN_TRIAL_STATES,
    SUMMARY_COLUMNS,
    Metric,
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
from service.dispatch import Planned, plan_groups, submit, suggest, trial_config
from service.resources import unmet
from service.spec import StudySpec
from service.studies import (
    finish_open_trials,
    make_pruner,
    make_sampler,
    optuna_storage,
    optuna_study_name,
)
from service.trial_events import Running, TrialEvents, take_batches
from workers import curves as M
from workers.remote import TrialInbox

__all__ = ["main", "run_study"]

log = logging.getLogger("qkscope.runner")
POLL_S = 1.0  # how often the loop looks for a cancel when no trial event woke it
WAIT_CHECK_S = 10.0  # how often queued trials are checked against the cluster's nodes
FLUSH_TIMEOUT_S = 60.0  # a finished trial waits at most this long for its last reports
TERMINAL = {StudyStatus.COMPLETED, StudyStatus.FAILED, StudyStatus.CANCELLED}


@dataclass
class _Finishing:
    """A trial whose task returned, waiting until the runner has stored all its reports."""

    entry: Running
    result: dict[str, Any]
    since: float


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
        self.storage = optuna_storage(settings.resolved_database_url())
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=optuna_study_name(study_id),
            directions=self.spec.directions(),  # type: ignore[arg-type]
            sampler=make_sampler(self.spec),
            pruner=make_pruner(self.spec),
            load_if_exists=True,
        )
        self.running: dict[Any, list[Running]] = {}  # a Ray task -> its trial(s)
        self.pending: deque[list[Planned]] = deque()  # asked groups waiting for a free slot
        self.by_number: dict[int, Running] = {}
        self.events = TrialEvents(self.spec, self.sessions, self.by_number)
        self.finishing: dict[int, _Finishing] = {}
        self._waiting: str | None = None
        self._waiting_checked = -math.inf

    # ---- asking and launching ------------------------------------------------------------

    def _launch(self, inbox: Any, group: list[Planned]) -> None:
        """One Ray task for the group (a single trial or a fused group)."""
        configs = [
            trial_config(self.spec, self.settings, self.study_id, p.params, p.number) for p in group
        ]
        ref = submit(self.spec, self.study_id, group, configs, inbox)
        now = time.monotonic()
        entries = [
            Running(trial=p.trial, row_id=p.row_id, number=p.number, started=now) for p in group
        ]
        self.running[ref] = entries
        for entry in entries:
            self.by_number[entry.number] = entry

    def _queue(self, planned: list[Planned]) -> None:
        """Group planned trials (by fusion key when `fuse > 1`) and queue the groups."""
        configs = [
            trial_config(self.spec, self.settings, self.study_id, p.params, p.number)
            for p in planned
        ]
        self.pending.extend(group for group, _ in plan_groups(self.spec, planned, configs))

    def _launch_pending(self, inbox: Any) -> None:
        while self.pending and len(self.running) < self.spec.parallelism:
            self._launch(inbox, self.pending.popleft())

    def _insert(self, number: int, params: dict[str, Any]) -> int:
        with session_scope(self.sessions) as s:
            row = Trial(
                study_id=self.study_id,
                number=number,
                params=params,
                seed=int(params.get("seed", self.spec.base.seed)),
                penalty_version=CURRENT_PENALTY_VERSION,
                state=TrialState.QUEUED,
            )
            s.add(row)
            s.flush()
            return row.id

    def _ask(self, n: int) -> None:
        """Ask Optuna for `n` trials, one after another, record them QUEUED and queue them."""
        planned: list[Planned] = []
        for _ in range(n):
            trial = with_retry(self.study.ask, "ask")
            params = with_retry(functools.partial(suggest, self.spec, trial), "suggest")
            insert = functools.partial(self._insert, trial.number, params)
            planned.append(Planned(trial, params, with_retry(insert, "insert trial")))
        self._queue(planned)

    def _resume_orphans(self, inbox: Any) -> None:
        """Trials Optuna still has RUNNING after a dead runner.

        Ours is the record of truth: a trial our table already shows finished (the runner
        died between recording it and telling Optuna) is told to Optuna as recorded, never
        run again; a running one is relaunched and resumes from its checkpoint.
        """
        orphans = self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
        relaunch: list[Planned] = []
        for ft in orphans:

            def claim(number: int = ft.number) -> Trial | None:
                with session_scope(self.sessions) as s:
                    row = s.scalars(
                        select(Trial).where(Trial.study_id == self.study_id, Trial.number == number)
                    ).one_or_none()
                    if row is not None and row.state == TrialState.RUNNING:
                        row.attempts += 1
                    return row

            row = with_retry(claim, "claim orphan")
            trial = optuna.Trial(self.study, ft._trial_id)
            if row is None or row.state in (TrialState.FAILED, TrialState.CANCELLED):
                # Asked but never recorded, or recorded as failed: give Optuna that answer.
                tell = functools.partial(
                    self.study.tell, ft.number, state=OptunaState.FAIL, skip_if_finished=True
                )
                with_retry(tell, "tell orphan")
            elif row.state not in OPEN_TRIAL_STATES:
                self._tell_recorded(trial, row)
            else:
                relaunch.append(Planned(trial, dict(row.params), row.id))
                log.info("relaunching trial %d (attempt %d)", ft.number, row.attempts)
        self._queue(relaunch)  # regrouped like new trials; each member resumes on its own

    def _tell_recorded(self, trial: optuna.Trial, row: Trial) -> None:
        """Tell Optuna the outcome our table recorded for a finished trial."""
        summary = row.summary or {}
        steps = int(self.spec.base.steps)
        constraints = [c.violation(summary, steps) for c in self.spec.constraints] or [0.0]
        values = [
            (math.inf if o.direction == "minimize" else -math.inf) if v is None else float(v)
            for o, v in zip(
                self.spec.objectives, row.values or [None] * len(self.spec.objectives), strict=False
            )
        ]
        entry = Running(trial=trial, row_id=row.id, number=row.number, started=time.monotonic())
        status = str(summary.get("status", "completed"))
        state = TrialState(row.state)
        with_retry(lambda: self._tell(entry, status, state, values, constraints), "tell recorded")
        log.info("trial %d was recorded %s before the runner died; told Optuna", row.number, state)

    # ---- results ------------------------------------------------------------------------------

    def _best_final_val_loss(self) -> float | None:
        """The study's best final validation loss so far: the reference for `trapped`."""

        def read() -> float | None:
            with session_scope(self.sessions) as s:
                return s.scalar(
                    select(func.min(Trial.final_val_loss)).where(
                        Trial.study_id == self.study_id, Trial.state == TrialState.COMPLETE
                    )
                )

        return with_retry(read, "best so far")

    def _count_metric_rows(self, s: Session, row_id: int) -> int:
        return int(s.scalar(select(func.count()).where(Metric.trial_id == row_id)) or 0)

    def _collect(self, ref: Any, entries: list[Running]) -> None:
        """A task returned (or failed): finish each of its trials once all its reports are
        stored. A failed group fails every member (Ray has already used up its retries)."""
        try:
            out: dict[str, Any] | list[dict[str, Any]] = ray.get(ref)
        except (ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError) as e:
            for entry in entries:
                self._fail(entry, f"{type(e).__name__}: {e}")
            return
        except Exception as e:
            for entry in entries:
                self._fail(entry, f"{type(e).__name__}: {str(e)[-2000:]}")
            return
        results = out if isinstance(out, list) else [out]
        now = time.monotonic()
        for entry, result in zip(entries, results, strict=True):
            self.finishing[entry.number] = _Finishing(entry, result, now)

    def _finish_ready(self) -> None:
        """Finish the returned trials whose reports have all been stored (the inbox's stream
        and a task's return value travel separately, so either may arrive first)."""
        for number, f in list(self.finishing.items()):
            sent = int(f.result.get("reports_sent", 0))
            got = f.entry.received.get(str(f.result.get("execution", "")), 0)
            if got < sent and time.monotonic() - f.since < FLUSH_TIMEOUT_S:
                continue
            if got < sent:
                log.warning("trial %d: %d of %d reports arrived; finishing", number, got, sent)
            del self.finishing[number]
            self._finish(f.entry, f.result)

    def _finish(self, entry: Running, result: dict[str, Any]) -> None:
        """Record a returned trial's outcome and tell Optuna."""
        summary: dict[str, Any] = result["summary"]
        status = summary["status"]
        steps = int(self.spec.base.steps)
        if summary.get("eval_steps") and not summary.get("trapped"):
            ref_loss = self._best_final_val_loss()
            last = summary["eval_steps"][-1]
            final = summary.get("final_val_loss")
            summary["trapped"] = bool(
                final is not None
                and M.is_trapped(
                    [tuple(p) for p in summary.get("plateaus", [])],
                    last,
                    final,
                    ref_loss,
                    float(self.spec.base.trapped_rel_gap),
                )
            )
        constraints = [c.violation(summary, steps) for c in self.spec.constraints] or [0.0]
        values: list[float] = []
        for obj in self.spec.objectives:
            v = summary.get(obj.metric)
            worst = math.inf if obj.direction == "minimize" else -math.inf
            values.append(worst if v is None or status == "diverged" else float(v))
        state = {
            "completed": TrialState.COMPLETE,
            "pruned": TrialState.PRUNED,
            "diverged": TrialState.DIVERGED,
        }[status]
        with_retry(
            lambda: self._record_result(entry, result, state, values, constraints), "record result"
        )
        with_retry(lambda: self._tell(entry, status, state, values, constraints), "tell")

    def _tell(
        self,
        entry: Running,
        status: str,
        state: TrialState,
        values: list[float],
        constraints: list[float],
    ) -> None:
        if self.storage.get_trial(entry.trial._trial_id).state.is_finished():
            return  # an earlier try got through before the connection dropped
        for i, (c, v) in enumerate(zip(self.spec.constraints, constraints, strict=False)):
            entry.trial.set_constraint(f"{i}:{c.metric}{c.op}", v)
        entry.trial.set_user_attr("qkscope_status", status)
        if state == TrialState.PRUNED:
            self.study.tell(entry.trial, state=OptunaState.PRUNED, skip_if_finished=True)
        else:
            self.study.tell(entry.trial, values, skip_if_finished=True)

    def _record_result(
        self,
        entry: Running,
        result: dict[str, Any],
        state: TrialState,
        values: list[float],
        constraints: list[float],
    ) -> None:
        summary: dict[str, Any] = result["summary"]
        with session_scope(self.sessions) as s:
            row = s.get(Trial, entry.row_id)
            assert row is not None
            row.state = state
            row.summary = summary
            row.node = result.get("node")
            row.values = [v if math.isfinite(v) else None for v in values]
            row.value = row.values[0]
            row.feasible = all(c <= 0 for c in constraints)
            for col in SUMMARY_COLUMNS:
                setattr(row, col, summary.get(col))
            row.last_step = int(summary.get("steps_done", row.last_step))
            row.finished_at = utcnow()
            row.duration_s = time.monotonic() - entry.started
            if result.get("started_at") and result.get("finished_at"):  # the task's own clock
                started = datetime.fromtimestamp(float(result["started_at"]), UTC)
                row.started_at = row.started_at or started
                row.finished_at = datetime.fromtimestamp(float(result["finished_at"]), UTC)
                row.duration_s = float(result["finished_at"]) - float(result["started_at"])
            row.waiting_reason = None
            row.metric_rows = self._count_metric_rows(s, entry.row_id)

    def _fail(self, entry: Running, reason: str) -> None:
        def write() -> None:
            with session_scope(self.sessions) as s:
                row = s.get(Trial, entry.row_id)
                assert row is not None
                row.state, row.error, row.finished_at = TrialState.FAILED, reason, utcnow()
                row.duration_s = time.monotonic() - entry.started
                row.metric_rows = self._count_metric_rows(s, entry.row_id)

        with_retry(write, "record failure")
        with_retry(
            lambda: self.study.tell(entry.trial, state=OptunaState.FAIL, skip_if_finished=True),
            "tell failure",
        )
        log.warning("trial %d failed: %s", entry.number, reason)

    # ---- the loop -----------------------------------------------------------------------------

    def _set_status(self, status: StudyStatus, error: str | None = None) -> None:
        """Move the study to `status`; a terminal status (e.g. a cancel) is never left."""

        def write() -> None:
            with session_scope(self.sessions) as s:
                row = s.get(Study, self.study_id)
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

    def _cancelled(self) -> bool:
        def read() -> bool:
            with session_scope(self.sessions) as s:
                status = s.scalar(select(Study.status).where(Study.id == self.study_id))
                return bool(status == StudyStatus.CANCELLED)

        return with_retry(read, "read status")

    def _cancel_all(self) -> None:
        for ref in self.running:
            ray.cancel(ref, force=True)
        for f in list(self.finishing.values()):  # returned before the cancel: keep the result
            self._finish(f.entry, f.result)
        entries = [e for group in self.running.values() for e in group]
        self.running.clear()
        self.finishing.clear()
        self.pending.clear()  # asked, never launched: finish_open_trials closes them below
        with_retry(
            lambda: finish_open_trials(
                self.sessions, self.storage, self.study_id, TrialState.CANCELLED, "study cancelled"
            ),
            "cancel trials",
        )

        def recount() -> None:
            # Cancelled here or by the API a moment ago: count what is stored now, after the
            # last batch this runner persisted.
            with session_scope(self.sessions) as s:
                s.execute(
                    update(Trial)
                    .where(
                        Trial.id.in_([e.row_id for e in entries]),
                        Trial.state == TrialState.CANCELLED,
                    )
                    .values(metric_rows=stored_metric_rows())
                )

        with_retry(recount, "count cancelled trials' rows")

    def run(self) -> StudyStatus:
        if self.status in TERMINAL:
            return self.status
        self._set_status(StudyStatus.RUNNING)
        # The inbox lives on the runner's node: it shares the runner's fate, never a worker's.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        inbox = TrialInbox.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]
        self._resume_orphans(inbox)
        t0 = time.monotonic()
        timeout = self.spec.budget.timeout_s
        asked = with_retry(lambda: len(self.study.get_trials(deepcopy=False)), "count trials")
        # One streaming call for the study's whole life: a batch whenever trials reported.
        stream = inbox.stream.options(num_returns="streaming").remote()
        try:
            while True:
                if self._cancelled():
                    self._cancel_all()
                    return StudyStatus.CANCELLED
                out_of_time = timeout is not None and time.monotonic() - t0 > timeout
                self._launch_pending(inbox)
                while (
                    not self.pending
                    and len(self.running) < self.spec.parallelism
                    and asked < self.spec.budget.n_trials
                    and not out_of_time
                ):
                    # Up to `fuse` trials per free slot; grouping may leave some queued.
                    free = self.spec.parallelism - len(self.running)
                    n = min(self.spec.fuse * free, self.spec.budget.n_trials - asked)
                    self._ask(n)
                    asked += n
                    self._launch_pending(inbox)
                if not self.running and not self.finishing and not self.pending:
                    break
                # Wake when a trial ends or reports, else after POLL_S to look for a cancel.
                refs = list(self.running)
                ready, _ = ray.wait([*refs, stream], num_returns=1, timeout=POLL_S)
                if refs:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                self.events.on_batches(take_batches(stream), inbox)
                for ref in ready:
                    self._collect(ref, self.running.pop(ref))
                self._finish_ready()
                self._check_waiting()
        finally:
            inbox.close.remote()
        self._set_status(StudyStatus.COMPLETED)
        return StudyStatus.COMPLETED

    def _check_waiting(self) -> None:
        """Trials that have not started, when no alive node can ever run one: say so on the
        study and its queued trials, those Ray holds (it would keep them pending without a
        word) and those still waiting here for a slot (a fused group that did not fit)."""
        now = time.monotonic()
        if now - self._waiting_checked < WAIT_CHECK_S:
            return
        self._waiting_checked = now
        queued = [e.row_id for group in self.running.values() for e in group if e.starts == 0]
        queued += [p.row_id for group in self.pending for p in group]
        reason = None
        if queued:
            alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
            nodes = [dict(n.get("Resources") or {}) for n in alive]
            res = self.spec.resources
            if problems := unmet(res.cpus, res.gpus, nodes):
                reason = (
                    "; ".join(f"{f}: {m}" for f, m in problems)
                    + ". Ray keeps the trials queued until such a node joins; cancel the study"
                    " or add one."
                )
        if reason == self._waiting:
            return
        self._waiting = reason
        log.warning("study %d: %s", self.study_id, reason or "trials are starting again")

        def write() -> None:
            with session_scope(self.sessions) as s:
                s.execute(
                    update(Study).where(Study.id == self.study_id).values(waiting_reason=reason)
                )
                s.execute(
                    update(Trial)
                    .where(Trial.id.in_(queued), Trial.state == TrialState.QUEUED)
                    .values(waiting_reason=reason)
                )

        with_retry(write, "waiting reason")


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
            runner._set_status(StudyStatus.FAILED, "".join(traceback.format_exception(e))[-4000:])
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
