"""service.runner.configs without Ray: trial configs and slot keys."""

from __future__ import annotations

from pathlib import Path

import optuna

from service.config import Settings
from service.runner.configs import slot_key, trial_config
from service.spec import StudySpec
from workers.fusion_plan import AUTO_FUSE_CPU, AUTO_FUSE_MAX_FLOPS, step_flops

SPACE = {
    "optim.lr": {"type": "categorical", "choices": [0.001, 0.003]},
    "model.d_model": {"type": "categorical", "choices": [32, 64]},
    "model.dropout": {"type": "categorical", "choices": [0.0, 0.1]},
}


class Planned:
    def __init__(self, trial: optuna.Trial, params: dict[str, object]) -> None:
        self.params, self.number = params, trial.number


def planned(spec: StudySpec, params: list[dict[str, object]]) -> list[Planned]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    return [Planned(study.ask(), p) for p in params]


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
    keys = [slot_key(spec, c, p.number) for c, p in zip(configs, plan, strict=True)]
    assert keys[0] == keys[2] and keys[0][1] == 4  # one key, a worker of `fuse` slots
    assert keys[1][0] != keys[0][0]
    assert keys[3] == ("alone:3", 1)  # refused by the fused model: a one-slot worker
    for p, c in zip(plan, configs, strict=True):  # each keeps its own config and directory
        assert c.optim.lr == p.params["optim.lr"]
        assert c.checkpoint.dir == str(tmp_path / "ckpt" / "study-7" / f"trial-{p.number}")
        assert c.checkpoint.owner == f"o/trial-{p.number}"


def test_fuse_auto_gives_each_key_the_slots_its_own_config_gains(tmp_path: Path) -> None:
    """A grid over depth: the base config's step is small (fused on a CPU), the 12-layer
    key's step is not (a one-slot worker): `fuse: auto` decides per key, not from the base."""
    space = {"model.n_layers": {"type": "int", "low": 1, "high": 12, "grid": [1, 12]}}
    base = {"model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "d_ff": 128}}
    task = {"kind": "lm", "data_dir": "wikitext-2", "tokenizer": "char", "vocab_cap": 256}
    base |= {"batch_size": 16, "task": task | {"seq_len": 64}}
    settings = Settings(home=tmp_path, checkpoint_dir=str(tmp_path / "ckpt"))
    keys = {}
    for fuse in ("auto", 4):
        spec = StudySpec.model_validate(
            {"name": "d", "base": base, "budget": {"n_trials": 2}, "search_space": space}
            | {"sampler": {"kind": "grid", "seed": 0}, "fuse": fuse}
        )
        plan = planned(spec, [{"model.n_layers": 1}, {"model.n_layers": 12}])
        configs = [trial_config(spec, settings, 7, p.params, p.number, owner="o") for p in plan]
        keys[fuse] = [slot_key(spec, c, p.number) for c, p in zip(configs, plan, strict=True)]
        assert [step_flops(c) < AUTO_FUSE_MAX_FLOPS for c in configs] == [True, False]
    assert [k[1] for k in keys["auto"]] == [AUTO_FUSE_CPU, 1]
    assert [k[1] for k in keys[4]] == [4, 4]  # an explicit fuse is what the user set
    assert [k[0] for k in keys["auto"]] == [k[0] for k in keys[4]]


def test_one_slot_workers_take_any_trial_of_their_device_and_precision(tmp_path: Path) -> None:
    """`fuse: 1`, under any sampler: one key for every trial of a device and precision,
    whatever its architecture, so a one-slot worker trains trial after trial."""
    settings = Settings(home=tmp_path, checkpoint_dir=str(tmp_path / "ckpt"))
    for fuse, sampler in ((1, "random"), (1, "tpe")):
        spec = StudySpec.model_validate(
            {"name": "o", "budget": {"n_trials": 3}, "search_space": SPACE, "fuse": fuse}
            | {"sampler": {"kind": sampler}}
        )
        params: list[dict[str, object]] = [
            {"optim.lr": 0.001, "model.d_model": 32, "model.dropout": 0.0},
            {"optim.lr": 0.003, "model.d_model": 64, "model.dropout": 0.1},
        ]
        plan = planned(spec, params)
        configs = [trial_config(spec, settings, 7, p.params, p.number) for p in plan]
        keys = {slot_key(spec, c, p.number) for c, p in zip(configs, plan, strict=True)}
        assert len(keys) == 1 and next(iter(keys))[1] == 1, keys
        other = configs[0].model_copy(update={"dtype": "bfloat16"})
        assert slot_key(spec, other, 9) not in keys  # another precision: another worker
