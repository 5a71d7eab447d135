"""Where a study's trials come from: Optuna's asks, recorded QUEUED in our table, and the
trials a dead runner left open, resumed.

The runner asks for one trial whenever a slot waits for one. An ask is idempotent: if the
connection drops after Optuna created the trial but before `ask` returned, the retry adopts
that trial (RUNNING in Optuna, no row of ours) instead of asking a second one, which would
stay RUNNING for ever.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from typing import Any

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.db.models import CURRENT_PENALTY_VERSION, OPEN_TRIAL_STATES, Trial, TrialState
from service.db.session import session_scope, with_retry
from service.dispatch import Planned, suggest
from service.spec import StudySpec

__all__ = ["TrialSource"]

log = logging.getLogger("qkscope.runner")


class TrialSource:
    """Asks Optuna for a study's trials and records them; finds a dead runner's open ones."""

    def __init__(
        self,
        spec: StudySpec,
        study: optuna.Study,
        sessions: sessionmaker[Session],
        study_id: int,
    ) -> None:
        self.spec, self.study, self.sessions, self.study_id = spec, study, sessions, study_id

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

    def _unrecorded_trial(self, launched: Collection[int]) -> optuna.Trial | None:
        """An Optuna trial asked by this runner whose row was never written, if any."""
        running = self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
        if not running:
            return None
        with session_scope(self.sessions) as s:
            recorded = set(
                s.scalars(
                    select(Trial.number).where(
                        Trial.study_id == self.study_id,
                        Trial.number.in_([t.number for t in running]),
                    )
                )
            )
        for ft in sorted(running, key=lambda t: t.number):
            if ft.number not in recorded and ft.number not in launched:
                return optuna.Trial(self.study, ft._trial_id)
        return None

    def ask(self, launched: Callable[[], Collection[int]]) -> Planned:
        """One trial, asked idempotently and recorded QUEUED. `launched`: the numbers the
        runner holds without a row of theirs being needed (none, in practice: rows are
        written right after the ask)."""

        def ask() -> optuna.Trial:
            return self._unrecorded_trial(launched()) or self.study.ask()

        trial = with_retry(ask, "ask")
        params = with_retry(functools.partial(suggest, self.spec, trial), "suggest")
        insert = functools.partial(self._insert, trial.number, params)
        return Planned(trial, params, with_retry(insert, "insert trial"))

    def resume_orphans(self, tell_recorded: Callable[[optuna.Trial, Trial], None]) -> list[Planned]:
        """Trials Optuna still has RUNNING after a dead runner; returns those to relaunch.

        Ours is the record of truth: a trial our table already shows finished (the runner
        died between recording it and telling Optuna) is told to Optuna as recorded, never
        run again; a running one is relaunched and resumes from its checkpoint (a slot
        member that had stopped finds its stop record and is finished without training).
        """
        relaunch: list[Planned] = []
        orphans = self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
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
                tell_recorded(trial, row)
                log.info("trial %d was recorded %s before the runner died", row.number, row.state)
            else:
                relaunch.append(Planned(trial, dict(row.params), row.id))
                log.info("relaunching trial %d (attempt %d)", ft.number, row.attempts)
        return relaunch
