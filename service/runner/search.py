"""The runner's Optuna side: the study with its sampler and pruner, asks, reports, tells.

Optuna's storage is the same database as ours; Optuna writes its own tables through it.
An ask is idempotent: if the connection drops after Optuna created the trial but before
`ask` returned, the retry adopts that trial (RUNNING in Optuna, no row of ours) instead of
asking a second one, which would stay RUNNING for ever. Constraints reach the samplers
that use them through `Trial.set_constraint` (Optuna 5).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from service.runner.configs import suggest
from service.spec import StudySpec
from service.store import Outcome, optuna_study_name, tell_outcome, with_retry

__all__ = ["Search", "make_pruner", "make_sampler"]


class _AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler for ask/tell. Optuna's calls `study.stop()` once the grid is used up,
    which raises outside `optimize()`; here the study's budget ends the study instead."""

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: OptunaState,
        values: Sequence[float] | None,
    ) -> None:
        return None


def make_sampler(spec: StudySpec) -> optuna.samplers.BaseSampler:
    """The spec's sampler."""
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
    if p.kind == "successive_halving":
        # Asynchronous successive halving (ASHA's rule): a trial goes on past each rung
        # (eval_every x 4^k steps) only while in the top quarter of the trials that got there.
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, spec.base.eval_every))
    return optuna.pruners.NopPruner()


class Search:
    """One study's Optuna study: ask, report, tell (on the runner's thread)."""

    def __init__(
        self, spec: StudySpec, study_id: int, storage: optuna.storages.BaseStorage
    ) -> None:
        self.spec, self.storage = spec, storage
        self.study = optuna.create_study(
            storage=storage,
            study_name=optuna_study_name(study_id),
            directions=spec.directions(),  # type: ignore[arg-type]
            sampler=make_sampler(spec),
            pruner=make_pruner(spec),
            load_if_exists=True,
        )

    def asked(self) -> int:
        """Trials asked so far (by any runner of this study)."""
        return with_retry(lambda: len(self.study.get_trials(deepcopy=False)), "count trials")

    def running(self) -> list[FrozenTrial]:
        return with_retry(
            lambda: self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,)),
            "running trials",
        )

    def ask(self, held: Collection[int], recorded: Callable[[list[int]], set[int]]) -> optuna.Trial:
        """A new trial, or the one a failed try of this ask created: RUNNING in Optuna,
        without a row of ours (`recorded`) and not held by this runner (`held`)."""

        def ask() -> optuna.Trial:
            running = self.study.get_trials(deepcopy=False, states=(OptunaState.RUNNING,))
            if running:
                have = recorded([t.number for t in running])
                for ft in sorted(running, key=lambda t: t.number):
                    if ft.number not in have and ft.number not in held:
                        return optuna.Trial(self.study, ft._trial_id)
            return self.study.ask()

        return with_retry(ask, "ask")

    def enqueue(self, params: dict[str, Any]) -> None:
        """Make the next ask a trial with these parameters (Optuna's fixed parameters: the
        grid sampler leaves such a trial alone), e.g. a ladder's bisection trial."""
        with_retry(lambda: self.study.enqueue_trial(params), "enqueue")

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """The trial's parameters (suggesting again returns what was suggested before)."""
        return with_retry(functools.partial(suggest, self.spec, trial), "suggest")

    def trial(self, frozen: FrozenTrial) -> optuna.Trial:
        return optuna.Trial(self.study, frozen._trial_id)

    def report(self, trial: optuna.Trial, step: int, value: float) -> bool:
        """Report an intermediate value; True when the pruner says stop. A trial that was
        finished while the report travelled keeps its outcome (False)."""
        try:
            with_retry(functools.partial(trial.report, value, step), "report")
        except UpdateFinishedTrialError:
            return False
        return with_retry(trial.should_prune, "should_prune")

    def tell(self, trial: optuna.Trial, outcome: Outcome) -> None:
        """Tell a trial's outcome with its constraint values (once: a retry after a dropped
        connection, or a cancel that told it first, finds it told)."""
        with_retry(
            functools.partial(tell_outcome, self.study, trial._trial_id, self.spec, outcome),
            "tell",
        )

    def tell_failed(self, trial: optuna.Trial | int) -> None:
        with_retry(
            lambda: self.study.tell(trial, state=OptunaState.FAIL, skip_if_finished=True),
            "tell failure",
        )
