"""Every sampler and pruner a spec can name drives a real Optuna study through ask/tell,
with the spec's search space and constraints."""

from __future__ import annotations

import optuna
import pytest

from service.runner.search import make_pruner, make_sampler
from service.spec import StudySpec

SPACE = {
    "optim.lr": {"type": "float", "low": 0.0001, "high": 0.1, "log": True, "grid": [0.001, 0.01]},
    "model.n_layers": {"type": "int", "low": 1, "high": 4, "grid": [1, 2]},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
}


@pytest.mark.parametrize("kind", ["random", "grid", "tpe", "cmaes", "gp", "nsga2"])
def test_sampler_runs_ask_tell_with_constraints(kind: str) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = StudySpec.model_validate({
        "name": "s", "budget": {"n_trials": 6}, "search_space": SPACE,
        "sampler": {"kind": kind, "seed": 1, "n_startup_trials": 2},
        "constraints": [{"metric": "min_norm_entropy", "op": ">=", "value": 0.1}],
    })  # fmt: skip

    study = optuna.create_study(sampler=make_sampler(spec), pruner=make_pruner(spec))
    for i in range(6):
        trial = study.ask()
        lr = trial.suggest_float("optim.lr", 0.0001, 0.1, log=True)
        n = trial.suggest_int("model.n_layers", 1, 4)
        norm = trial.suggest_categorical("model.norm", ["pre", "post"])
        assert 0.0001 <= lr <= 0.1 and 1 <= n <= 4 and norm in ("pre", "post")
        if kind == "grid":
            assert lr in (0.001, 0.01) and n in (1, 2)
        trial.set_constraint("0:min_norm_entropy>=", 0.1 - (i % 3) / 10)
        study.tell(trial, lr * n)
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(done) == 6
    assert [t.constraints for t in done] == [
        {"0:min_norm_entropy>=": 0.1 - (i % 3) / 10} for i in range(6)
    ]


@pytest.mark.parametrize(
    "kind", ["none", "median", "percentile", "hyperband", "successive_halving"]
)
def test_pruner_kinds_build_and_answer(kind: str) -> None:
    spec = StudySpec.model_validate(
        {"name": "p", "budget": {"n_trials": 1}, "pruner": {"kind": kind}}
    )
    study = optuna.create_study(pruner=make_pruner(spec))
    for value in (1.0, 2.0, 3.0):
        t = study.ask()
        for step in (50, 100, 150):
            t.report(value, step)
        assert t.should_prune() in (True, False)  # Optuna may answer with numpy.bool_
        study.tell(t, value)
    assert isinstance(study.pruner, optuna.pruners.NopPruner) == (kind == "none")
