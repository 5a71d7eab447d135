"""One study's runner loop: schedule -> run -> post-process, until the budget is spent.

- schedule: ask Optuna for a trial whenever a slot waits for one, and place waiting trials
  in slot workers (service/runner/scheduler.py);
- run: wait until workers say something or a worker's task ends (service/runner/pool.py);
- post-process: the scheduler updates its records from what workers said and returns
  typed outputs (`Scheduler.postprocess`); the loop only hands them on: starts and reports
  to the store and the reports' values to the pruner (service/runner/reports.py), each
  finished trial's outcome to the store and to Optuna (service/runner/results.py).

Every row goes through the store (service/store/), every Optuna call through `Search`, every
Ray call through the pool; the scheduler alone moves a trial's status. Every write is fenced
by the runner's job attempt (service/store/fence.py): once another attempt of the study was
launched, the next write raises `Superseded` and changes nothing, and Optuna hears only what
a fenced write recorded first. A rerun of the same study (after the job or the cluster
died) picks up where the database says it stopped:
trials that were running are relaunched with the same parameters and resume from their
checkpoints; a trial our table recorded but Optuna never heard of is told as recorded.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC
from typing import TYPE_CHECKING, Any

import optuna

from service.config import Settings
from service.runner import configs
from service.runner.ladder import Ladder
from service.runner.pool import Ended, RayPool
from service.runner.records import TrialRecord
from service.runner.reports import Reports
from service.runner.results import judge, judge_stored, result_row
from service.runner.scheduler import FLUSH_TIMEOUT_S, Scheduler
from service.runner.search import Search
from service.runner.standby import Warm
from service.runner.waiting import WaitingReason
from service.spec import SpecError, StudySpec
from service.store import (
    OPEN_TRIAL_STATES,
    TERMINAL,
    Fence,
    Store,
    StudyStatus,
    TrialState,
    make_sessionmaker,
    optuna_storage,
    with_retry,
)
from workers.config import TrialConfig
from workers.messages import Batch

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["FLUSH_TIMEOUT_S", "POLL_S", "StudyRunner"]

log = logging.getLogger("qkscope.runner")
POLL_S = 1.0  # how often the loop looks for a cancel when no worker woke it


class StudyRunner:
    """One study's control loop. All database, Optuna and Ray calls happen on this thread."""

    def __init__(
        self,
        study_id: int,
        settings: Settings,
        engine: Engine,
        attempt: int | None = None,
        warm: Warm | None = None,
    ) -> None:
        """`attempt`: the job attempt this runner was launched as (the entrypoint's); None
        (run by hand): the study's current one. `warm`: what a standby prepared (its Optuna
        storage and inbox), taken over instead of making them."""
        self.study_id, self.settings = study_id, settings
        reader = Store(make_sessionmaker(engine))  # unfenced: it only reads the study row
        row = reader.studies.get(study_id)
        if row is None:
            raise LookupError(f"study {study_id} not found")
        self.spec = StudySpec.model_validate(row.spec)
        self.status = StudyStatus(row.status)
        # this runner's job attempt (0: run by hand, never launched); every write it makes
        # holds only while that is the study's current attempt (service/store/fence.py)
        self.attempt = row.job_attempts if attempt is None else attempt
        self.store = Store(reader.sessions, Fence(study_id, self.attempt))
        # whose checkpoints: a new study with the same id (a reset database) is another
        self.owner = f"study-{study_id}@{row.created_at.isoformat()}"
        self.warm = warm
        self.storage = warm.storage if warm else optuna_storage(settings.resolved_database_url())
        self.search = Search(self.spec, study_id, self.storage)
        self.waiting = WaitingReason(self.spec, self.store.studies, study_id)
        # a width ladder's bisection after the grid (service/runner/ladder.py)
        self.ladder = Ladder(self.spec, study_id, self.store) if Ladder.wanted(self.spec) else None

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> StudyStatus:
        if self.status in TERMINAL:
            return self.status
        self.store.studies.set_status(self.study_id, StudyStatus.RUNNING)
        inbox = (self.warm.inbox, self.warm.inbox_workers) if self.warm else None
        self.pool = RayPool(self.spec, self.settings.inbox_max_messages, inbox=inbox)
        self.scheduler = Scheduler(self.spec, self.study_id, self.pool)
        self.reports = Reports(
            self.spec, self.store.trials, self.search, self.pool.stop_trial, self.pool.judged
        )
        try:
            resumed = self._resume()
            asked, t0 = self.search.asked(), self._started_at()
            self.scheduler.resume(resumed, left=asked - len(resumed))
            while True:
                if self.store.studies.status(self.study_id) == StudyStatus.CANCELLED:
                    self._cancel()
                    return StudyStatus.CANCELLED
                asked = self._schedule(asked, t0)
                if not self.scheduler.busy():
                    break
                batch, ended = self.pool.wait(POLL_S)
                self._post_process(batch, ended)
        finally:
            self.pool.close_inbox()
        self.store.studies.set_status(self.study_id, StudyStatus.COMPLETED)
        return StudyStatus.COMPLETED

    def _started_at(self) -> float:
        """When the study first started (unix time): `budget.timeout_s` counts from there,
        not from this runner's start (a relaunched runner must not restart the clock)."""
        row = with_retry(lambda: self.store.studies.get(self.study_id), "read study")
        started = row.started_at if row is not None else None
        if started is None:
            return time.time()
        return (started if started.tzinfo else started.replace(tzinfo=UTC)).timestamp()

    def _schedule(self, asked: int, t0: float) -> int:
        """Place waiting trials; ask one more for each slot that still waits (or a look
        ahead: see `Scheduler.may_ask`); close workers nothing will come to. Returns how
        many trials the study has asked."""
        timeout = self.spec.budget.timeout_s
        out_of_time = timeout is not None and time.time() - t0 > timeout
        self.scheduler.schedule()
        while (
            self.scheduler.may_ask()
            and self.scheduler.room() > 0
            and asked < self.spec.budget.n_trials
            and not out_of_time
        ):
            if self.ladder is not None and asked >= self.ladder.grid:
                # the grid is asked: only a ladder's bisection trials from here on
                params = self.ladder.next()
                if params is None:
                    break
                self.search.enqueue(params)
            self._ask()
            asked += 1
            self.scheduler.schedule()
        more = asked < self.spec.budget.n_trials and not out_of_time
        if more and self.ladder is not None and asked >= self.ladder.grid:
            # past the grid a ladder asks only what a finished trial makes it propose: with
            # nothing proposed and nothing in flight, it is done (the workers may go)
            more = self.ladder.pending() or bool(self.scheduler.records)
        self.scheduler.close_idle(more)
        return asked

    def _post_process(self, batch: Batch, ended: list[Ended], *, force: bool = False) -> None:
        """Hand what the scheduler made of the workers' messages to the store and the search."""
        for e in ended:
            if e.done is not None:
                log.info(
                    "%s ended: %d member-steps computed for %d members",
                    e.name,
                    e.done.steps,
                    e.done.members,
                )
            else:
                log.warning("%s ended: %s", e.name, e.error)
        out = self.scheduler.postprocess(batch, ended, force=force)
        self.reports.record_starts(out.starts)
        self.reports.store(out.reports)
        self.reports.store_after_end(out.after_end)
        self.reports.prune(out.values)
        for rec, reason in out.failed:
            self._fail(rec, reason)
        for rec in out.finished:
            if rec in out.late:
                assert rec.result is not None
                log.warning(
                    "trial %d: not all %d reports arrived in %.0f s; finishing (the rest are"
                    " stored when they come)",
                    rec.number,
                    rec.result.reports_sent,
                    FLUSH_TIMEOUT_S,
                )
            self._record_result(rec)
        self.waiting.check(self.scheduler.queued_rows())

    # ---- trials in and out ---------------------------------------------------------------

    def _ask(self) -> None:
        self.store.studies.check_current()  # a stale runner asks Optuna for nothing
        trial = self.search.ask(
            self.scheduler.records.keys(),
            lambda numbers: self.store.trials.recorded_numbers(self.study_id, numbers),
        )
        if (rec := self._new_record(trial)) is not None:
            self.scheduler.add(rec)

    def _new_record(self, trial: optuna.Trial) -> TrialRecord | None:
        """Record an asked trial QUEUED (its parameters suggested now), then admit it."""
        params: dict[str, Any] = {}
        problem = None
        try:
            params = self.search.suggest(trial)
        except (SpecError, ValueError) as e:
            problem = f"invalid parameters {params}: {e}"
        seed = params.get("seed", self.spec.base.seed)
        row_id = self.store.trials.insert_queued(
            self.study_id, trial.number, params, int(seed) if isinstance(seed, int) else 0
        )
        return self._admit(trial, row_id, params, problem=problem)

    def _admit(
        self,
        trial: optuna.Trial,
        row_id: int,
        params: dict[str, Any],
        attempts_before: int = 0,
        problem: str | None = None,
    ) -> TrialRecord | None:
        """The one admission path, for a new trial and a relaunched one: its config, slot
        key and stop rules; a trial whose parameters make no valid config (or that Optuna
        could not suggest: `problem`) fails alone, with the reason, and gives None: a point
        of the search space never fails the whole study."""
        config: TrialConfig | None = None
        if problem is None:
            try:
                config = configs.trial_config(
                    self.spec, self.settings, self.study_id, params, trial.number, owner=self.owner
                )
            except (SpecError, ValueError) as e:
                problem = f"invalid parameters {params}: {e}"
        if config is None:
            rec = TrialRecord(trial, row_id, params, None)
            self._fail(rec, problem or "no config")
            return None
        key, slots = configs.slot_key(self.spec, config, trial.number)
        rules = configs.stop_rules(self.spec, config.steps)  # its own steps
        return TrialRecord(
            trial, row_id, params, config, key=key, slots=slots, stop_rules=rules,
            attempts_before=attempts_before,
        )  # fmt: skip

    def _resume(self) -> list[TrialRecord]:
        """Trials Optuna still has RUNNING after a dead runner: relaunched, told as our
        table recorded them (ours is the record of truth), or adopted when the dead runner
        asked them and died before writing their row."""
        out: list[TrialRecord] = []
        for ft in self.search.running():
            trial = self.search.trial(ft)
            row = self.store.trials.claim_orphan(self.study_id, ft.number, self.attempt)
            if row is None:
                if (rec := self._new_record(trial)) is not None:
                    out.append(rec)
                continue
            state = TrialState(row.state)
            if state in (TrialState.FAILED, TrialState.CANCELLED):
                self.search.tell_failed(trial)
            elif state not in OPEN_TRIAL_STATES:
                j = judge_stored(self.spec, state, row.summary, row.values, dict(row.params))
                self.search.tell(trial, j.outcome)
                log.info("trial %d was recorded %s before the runner died", row.number, state)
            else:
                # the claim counted this relaunch: attempts before it are one fewer
                rec = self._admit(trial, row.id, dict(row.params), row.attempts - 1)
                if rec is not None:
                    out.append(rec)
                    log.info("relaunching trial %d (attempt %d)", row.number, row.attempts)
        return out

    def _record_result(self, rec: TrialRecord) -> None:
        """A finished trial's outcome: judged, written (unless its row ended first: a
        cancel), told to Optuna, and the record done."""
        end = rec.result
        assert end is not None
        judged = judge(
            self.spec,
            end.summary,
            lambda: self.store.trials.best_final_val_loss(self.study_id),
            rec.config.steps if rec.config is not None else None,
        )
        row = result_row(judged, end, time.monotonic() - rec.launched)
        if self.store.trials.record_result(rec.row_id, row):
            self.search.tell(rec.trial, judged.outcome)
        self.scheduler.done(rec)
        if self.ladder is not None:
            self.ladder.changed()

    def _fail(self, rec: TrialRecord, reason: str) -> None:
        """Record a failure at once (unless the row ended first) and tell Optuna FAIL."""
        self.store.trials.record_failure(rec.row_id, reason, time.monotonic() - rec.launched)
        self.search.tell_failed(rec.trial)
        self.scheduler.done(rec)
        log.warning("trial %d failed: %s", rec.number, reason)

    def _cancel(self) -> None:
        """The study was cancelled: stop the workers, keep what arrived before, close the
        rest (ours and Optuna's)."""
        self.pool.cancel_all()
        self._post_process(Batch(), [], force=True)  # what finished before: recorded
        rows = self.scheduler.clear()
        self.close_open(TrialState.CANCELLED, "study cancelled")
        self.store.trials.recount(rows)

    def stop_workers(self) -> None:
        """Cancel every slot worker's task (the study failed)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            with contextlib.suppress(Exception):
                pool.cancel_all()

    def close_open(self, state: TrialState, reason: str) -> None:
        self.store.trials.finish_open(self.study_id, state, reason, self.storage)
