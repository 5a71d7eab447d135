"""The trial config refuses what cannot be a sound trial (workers/config.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from workers.config import CAUSAL_ONLY_TASKS, TrialConfig
from workers.tasks import IGNORE_INDEX, build_task

SYNTH: dict[str, Any] = {"seq_len": 16, "n_pairs": 4, "n_symbols": 8, "n_valid": 8}


def _task(kind: str) -> dict[str, Any]:
    return {"kind": kind, "data_dir": "wikitext-2"} if kind == "lm" else {"kind": kind, **SYNTH}


@pytest.mark.parametrize("kind", ["lm", "sort", "copy"])
def test_bidirectional_attention_is_refused_where_the_targets_are_later_inputs(kind: str) -> None:
    """`model.causal: false` on a task that predicts its own next input token would let every
    query see its answer: refused, located at model.causal, the message naming the field and
    the task."""
    with pytest.raises(ValidationError) as e:
        TrialConfig.model_validate({"task": _task(kind), "model": {"causal": False}})
    errors = e.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("model", "causal"), errors
    assert "model.causal" in errors[0]["msg"] and repr(kind) in errors[0]["msg"]
    # the same task with the mask, and associative recall without it, are valid
    assert TrialConfig.model_validate({"task": _task(kind)}).model.causal is True
    ar = TrialConfig.model_validate(
        {"task": _task("associative_recall"), "model": {"causal": False}}
    )
    assert ar.model.causal is False


@pytest.mark.parametrize("kind", ["sort", "copy", "associative_recall"])
def test_the_refused_tasks_are_those_whose_targets_are_later_inputs(kind: str) -> None:
    """The rule follows the data (workers/tasks.py): a task is refused exactly when some
    target equals the input token at the next position."""
    task = build_task(TrialConfig.model_validate({"task": _task(kind)}).task, seed=0)
    x, y = task.train_batch(64, torch.Generator().manual_seed(0))
    has = y != IGNORE_INDEX
    nxt = torch.full_like(x, -1)
    nxt[:, :-1] = x[:, 1:]
    leaks = bool((y[has] == nxt[has]).all())
    assert leaks == (kind in CAUSAL_ONLY_TASKS)
    assert "lm" in CAUSAL_ONLY_TASKS  # y[t] = x[t + 1] by construction (LMTask._windows)
