"""service.dispatch without Ray: launch groups by fusion key and the tasks' dashboard names."""

from __future__ import annotations

from pathlib import Path

import optuna

from service.config import Settings
from service.dispatch import Planned, plan_groups, task_name, trial_config
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


def test_groups_follow_the_fusion_key_and_the_size_limit(tmp_path: Path) -> None:
    params: list[dict[str, object]] = [
        {"optim.lr": 0.001, "model.d_model": 32, "model.dropout": 0.0},  # A
        {"optim.lr": 0.003, "model.d_model": 64, "model.dropout": 0.0},  # B
        {"optim.lr": 0.003, "model.d_model": 32, "model.dropout": 0.0},  # A
        {"optim.lr": 0.001, "model.d_model": 32, "model.dropout": 0.1},  # not fusable
        {"optim.lr": 0.003, "model.d_model": 32, "model.dropout": 0.0},  # A, over the limit
    ]
    settings = Settings(home=tmp_path, checkpoint_dir=str(tmp_path / "ckpt"))
    for fuse, want in ((1, [[0], [1], [2], [3], [4]]), (2, [[0, 2], [1], [3], [4]])):
        spec = StudySpec.model_validate(
            {"name": "g", "budget": {"n_trials": 5}, "search_space": SPACE, "fuse": fuse}
        )
        plan = planned(spec, params)
        configs = [trial_config(spec, settings, 7, p.params, p.number) for p in plan]
        groups = plan_groups(spec, plan, configs)
        assert [[p.number for p in g] for g, _ in groups] == want
        for g, cs in groups:  # each member keeps its own config and checkpoint dir
            for p, c in zip(g, cs, strict=True):
                assert c.optim.lr == p.params["optim.lr"]
                assert c.checkpoint.dir == str(tmp_path / "ckpt" / "study-7" / f"trial-{p.number}")


def test_task_names_show_the_member_trials() -> None:
    assert task_name(3, [5]) == "study-3/trial-5"
    assert task_name(3, [7, 4, 5, 6]) == "study-3/trials-4-7"
    assert task_name(3, [2, 9, 5]) == "study-3/trials-2,5,9"
