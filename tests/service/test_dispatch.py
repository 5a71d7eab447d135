"""service.dispatch and service.slots without Ray: trial configs, slot keys, task names."""

from __future__ import annotations

from pathlib import Path

import optuna

from service.config import Settings
from service.dispatch import Planned, task_name, trial_config
from service.slots import slot_key
from service.spec import StudySpec

SPACE = {
    "optim.lr": {"type": "categorical", "choices": [0.001, 0.003]},
    "model.d_model": {"type": "categorical", "choices": [32, 64]},
    "model.dropout": {"type": "categorical", "choices": [0.0, 0.1]},
}


def planned(spec: StudySpec, params: list[dict[str, object]]) -> list[Planned]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    return [Planned(study.ask(), p, row_id=i + 100) for i, p in enumerate(params)]


def test_slot_keys_follow_the_fusion_key(tmp_path: Path) -> None:
    params: list[dict[str, object]] = [
        {"optim.lr": 0.001, "model.d_model": 32, "model.dropout": 0.0},  # A
        {"optim.lr": 0.003, "model.d_model": 64, "model.dropout": 0.0},  # B
        {"optim.lr": 0.003, "model.d_model": 32, "model.dropout": 0.0},  # A
        {"optim.lr": 0.001, "model.d_model": 32, "model.dropout": 0.1},  # not fusable
    ]
    settings = Settings(home=tmp_path, checkpoint_dir=str(tmp_path / "ckpt"))
    spec = StudySpec.model_validate(
        {"name": "g", "budget": {"n_trials": 4}, "search_space": SPACE, "fuse": 4}
    )
    plan = planned(spec, params)
    configs = [trial_config(spec, settings, 7, p.params, p.number, owner="o") for p in plan]
    keys = [slot_key(c, p.number) for c, p in zip(configs, plan, strict=True)]
    assert keys[0] == keys[2] and keys[0][1] is None  # one key, a worker of `fuse` slots
    assert keys[1][0] != keys[0][0]
    assert keys[3] == ("alone:3", 1)  # refused by the fused model: a one-slot worker
    for p, c in zip(plan, configs, strict=True):  # each keeps its own config and directory
        assert c.optim.lr == p.params["optim.lr"]
        assert c.checkpoint.dir == str(tmp_path / "ckpt" / "study-7" / f"trial-{p.number}")
        assert c.checkpoint.owner == f"o/trial-{p.number}"


def test_task_names_show_the_trial() -> None:
    assert task_name(3, [5]) == "study-3/trial-5"
