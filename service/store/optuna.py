"""Optuna's storage in the study database: the one place it is opened.

Optuna keeps its own tables (`studies`, `trials`, ...) beside ours; it writes them itself
through this storage. A trial's outcome reaches Optuna through `tell_outcome` only: the
runner tells what it just recorded, and a cancel or a give-up (`close_optuna_trials`) tells
Optuna what our table recorded for trials that ended with a result, and FAIL for the rest.
Both compute the told values the same way (`stored_outcome`), so whichever comes first,
Optuna and our table agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState as OptunaState
from sqlalchemy import event
from sqlalchemy.exc import SQLAlchemyError

from service.store.models import TrialState
from service.store.session import (
    discard_weather_connections,
    normalize_url,
    pg_connect_args,
    sqlite_pragmas,
)

if TYPE_CHECKING:
    from service.spec import StudySpec

__all__ = [
    "Outcome",
    "close_optuna_trials",
    "constraint_values",
    "objective_values",
    "optuna_storage",
    "optuna_study_name",
    "stored_outcome",
    "tell_outcome",
    "trial_steps",
]


def optuna_study_name(study_id: int) -> str:
    return f"qkscope-{study_id}"


def optuna_storage(url: str, *, create_tables: bool = True) -> optuna.storages.RDBStorage:
    """Optuna's RDBStorage on the study database, with the project's SQLite pragmas."""
    url = normalize_url(url)
    pre_ping: dict[str, Any] = (
        {}
        if url.startswith("sqlite")
        else {"pool_pre_ping": True, "connect_args": pg_connect_args(url)}
    )
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
    else:  # and ours: a read-only server's connections are discarded, not pooled
        event.listen(storage.engine, "handle_error", discard_weather_connections)
    return storage


@dataclass(frozen=True, slots=True)
class Outcome:
    """What Optuna is told about one trial that ended with a result."""

    status: str  # the worker's: completed, pruned, diverged
    state: TrialState
    values: list[float]  # objective values (the worst value where there is none)
    constraints: list[float]  # Optuna's convention: <= 0 is feasible


def objective_values(spec: StudySpec, stored: list[Any]) -> list[float]:
    """Objective values as told: a missing (None) or non-finite value is the worst value."""
    out: list[float] = []
    for obj, v in zip(spec.objectives, stored, strict=False):
        worst = math.inf if obj.direction == "minimize" else -math.inf
        out.append(worst if v is None or not math.isfinite(float(v)) else float(v))
    return out


def trial_steps(spec: StudySpec, params: Mapping[str, Any] | None) -> int:
    """The trial's own `steps`: its parameter where the study searches `steps`, else the
    base config's (what a constraint's `fraction_of_steps` is a fraction of)."""
    v = (params or {}).get("steps")
    if isinstance(v, int | float) and not isinstance(v, bool):
        return int(v)
    return int(spec.base.steps)


def constraint_values(
    spec: StudySpec, summary: Mapping[str, Any], steps: int | None = None
) -> list[float]:
    """Each constraint's violation (<= 0 feasible); `steps`: the trial's own (its
    `fraction_of_steps` bound), the base config's when None."""
    steps = int(spec.base.steps) if steps is None else steps
    return [c.violation(dict(summary), steps) for c in spec.constraints] or [0.0]


def stored_outcome(
    spec: StudySpec,
    state: TrialState,
    summary: Mapping[str, Any] | None,
    values: list[Any] | None,
    params: Mapping[str, Any] | None = None,
) -> Outcome:
    """The outcome a recorded row stands for (its stored summary, values and params)."""
    summary = summary or {}
    stored = values or [None] * len(spec.objectives)
    return Outcome(
        str(summary.get("status", "completed")),
        state,
        objective_values(spec, stored),
        constraint_values(spec, summary, trial_steps(spec, params)),
    )


def tell_outcome(study: optuna.Study, trial_id: int, spec: StudySpec, outcome: Outcome) -> None:
    """Tell Optuna a trial's outcome with its constraint values, once: a trial Optuna has
    already finished keeps what it has.

    The other writer (a cancel or give-up, `close_optuna_trials`, against the runner) can
    finish the trial at any point after the check, between any two of these writes: each
    write refuses a finished trial (`UpdateFinishedTrialError`), and that refusal means the
    other writer won, never an error (before: only the final tell was covered, so a cancel
    landing after the check made the runner raise, the cancel answer 500 and a reconcile
    round abort)."""
    if study._storage.get_trial(trial_id).state.is_finished():
        return
    trial = optuna.Trial(study, trial_id)
    try:
        for i, (c, v) in enumerate(zip(spec.constraints, outcome.constraints, strict=False)):
            trial.set_constraint(f"{i}:{c.metric}{c.op}", v)
        trial.set_user_attr("qkscope_status", outcome.status)
        if outcome.state == TrialState.PRUNED:
            study.tell(trial, state=OptunaState.PRUNED, skip_if_finished=True)
        else:
            study.tell(trial, outcome.values, skip_if_finished=True)
    except UpdateFinishedTrialError:  # the other writer told it in between
        return


def close_optuna_trials(
    storage: optuna.storages.BaseStorage,
    study_id: int,
    status: str,
    spec: StudySpec,
    recorded: Mapping[int, Outcome],
) -> None:
    """Finish the study's RUNNING Optuna trials: those our table recorded with a result
    (`recorded`, by trial number) as recorded, the others FAIL (user attr
    `qkscope_status`). Call it after our open rows were closed, so that a result the runner
    recorded before that is in `recorded`."""
    try:
        optuna_id = storage.get_study_id_from_name(optuna_study_name(study_id))
    except Exception:  # never launched: Optuna has no such study (or no tables) yet
        return
    running = storage.get_all_trials(optuna_id, deepcopy=False, states=(OptunaState.RUNNING,))
    study: optuna.Study | None = None
    for t in running:
        if (outcome := recorded.get(t.number)) is not None:
            if study is None:
                study = optuna.load_study(study_name=optuna_study_name(study_id), storage=storage)
            tell_outcome(study, t._trial_id, spec, outcome)
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "qkscope_status", status)
            storage.set_trial_state_values(t._trial_id, OptunaState.FAIL)
        except UpdateFinishedTrialError:  # the runner told it first
            continue
