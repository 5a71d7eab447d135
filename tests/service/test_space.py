"""The search-space check (service/spec/space.py): what it enumerates, that it stays cheap on huge
spaces, and that what it accepts Optuna can really sample without a failing trial config."""

from __future__ import annotations

import json
import time
from typing import Any

import optuna
import pytest

from service.spec import IntParam, SpecError, apply_params, parse_spec
from service.spec.space import ENUM_MAX, candidate_values

BASE: dict[str, Any] = {"name": "s", "budget": {"n_trials": 4}}


def parse(search_space: dict[str, Any], **extra: Any) -> Any:
    body = {**BASE, **extra, "search_space": search_space}
    return parse_spec(json.dumps(body).encode(), "application/json")


def test_int_ranges_are_enumerated_as_optuna_rounds_them() -> None:
    values, exhaustive = candidate_values(
        IntParam(type="int", low=10, high=105, step=10), grid_sampler=False
    )
    assert exhaustive and values == list(range(10, 101, 10))  # 105 is never suggested
    values, exhaustive = candidate_values(
        IntParam(type="int", low=0, high=10 * ENUM_MAX), grid_sampler=False
    )
    assert not exhaustive and values[0] == 0 and max(values) == 10 * ENUM_MAX
    assert len(values) < 100


def test_huge_spaces_are_checked_in_bounded_time() -> None:
    space = {
        "seed": {"type": "int", "low": 0, "high": 2**30},
        "steps": {"type": "int", "low": 1000, "high": 1_000_000},
        "optim.warmup_steps": {"type": "int", "low": 0, "high": 999},
        "task.seq_len": {"type": "int", "low": 64, "high": 4096},
        "task.n_pairs": {"type": "int", "low": 1, "high": 16},
        "task.n_symbols": {"type": "int", "low": 16, "high": 4096},
        "model.d_model": {"type": "categorical", "choices": [64 * i for i in range(1, 65)]},
        "model.n_heads": {"type": "categorical", "choices": [1, 2, 4, 8, 16, 32, 64]},
        **{
            f"optim.{k}": {"type": "float", "low": 0.01, "high": 0.5}
            for k in ("weight_decay", "beta1")
        },
    }
    t0 = time.perf_counter()
    parse(space, base={"steps": 1000})
    assert time.perf_counter() - t0 < 10.0  # ~1 s on a quiet core


@pytest.mark.parametrize(
    ("space", "field", "value"),
    [
        ({"model.n_heads": {"type": "int", "low": 1, "high": 8}}, "model.n_heads", "=3"),
        (
            {
                "model.d_model": {"type": "int", "low": 64, "high": 128, "step": 32},
                "model.n_heads": {"type": "categorical", "choices": [2, 64]},
            },
            "model.n_heads",
            "model.d_model=96, model.n_heads=64",
        ),
        (
            {
                "task.kind": {"type": "categorical", "choices": ["copy", "associative_recall"]},
                "task.n_pairs": {"type": "int", "low": 1, "high": 16},
            },
            "task.n_pairs",
            "task.kind='associative_recall', task.n_pairs=10",
        ),
    ],
)
def test_failing_points_are_named_with_their_values(
    space: dict[str, Any], field: str, value: str
) -> None:
    base = {"model": {"d_model": 32}, "task": {"kind": "copy", "seq_len": 20}}
    with pytest.raises(SpecError) as e:
        parse(space, base=base if "model.d_model" not in space else {})
    assert e.value.field == f"search_space.{field}"
    assert value in e.value.message


def test_a_task_and_a_mask_that_only_fail_together_are_refused() -> None:
    """Each value is fine alone on an associative-recall base; copy without the causal mask
    lets attention see its targets (workers/config.py), so the pair is refused at POST."""
    space = {
        "task.kind": {"type": "categorical", "choices": ["associative_recall", "copy"]},
        "model.causal": {"type": "categorical", "choices": [True, False]},
    }
    base = {"task": {"kind": "associative_recall", "seq_len": 20}}
    with pytest.raises(SpecError) as e:
        parse(space, base=base)
    assert e.value.field in ("search_space.model.causal", "search_space.task.kind")
    assert "model.causal=False" in e.value.message and "'copy'" in e.value.message


ACCEPTED = [
    {
        "model.d_model": {"type": "categorical", "choices": [32, 64, 96]},
        "model.n_heads": {"type": "int", "low": 1, "high": 2},
        "steps": {"type": "int", "low": 50, "high": 400},
        "optim.warmup_steps": {"type": "int", "low": 0, "high": 50},
        "optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
    },
    {
        "task.n_pairs": {"type": "int", "low": 1, "high": 8},
        "task.seq_len": {"type": "int", "low": 18, "high": 64, "step": 2},
        "task.n_symbols": {"type": "int", "low": 8, "high": 64, "log": True},
        "model.n_layers": {"type": "int", "low": 1, "high": 4},
    },
]


@pytest.mark.parametrize("space", ACCEPTED)
def test_what_is_accepted_optuna_samples_without_a_failing_config(space: dict[str, Any]) -> None:
    """The runner's own suggest on a real Optuna study: every trial config applies."""
    from service.runner.configs import suggest

    spec = parse(space)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for sampler in (optuna.samplers.RandomSampler(seed=0), optuna.samplers.TPESampler(seed=1)):
        study = optuna.create_study(sampler=sampler)
        for _ in range(150):
            trial = study.ask()
            apply_params(spec.base, suggest(spec, trial))
            study.tell(trial, float(trial.number % 7))
