"""Hundreds of bad study definitions POSTed to one app per database: always a 4xx with a JSON
error body that names the field, never a 5xx, and never a row in qk_study."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from service.app import create_app
from service.config import Settings
from service.spec import StudySpec
from service.store.session import make_engine
from tests.service.helpers import VALID, check_rejected, n_studies, names_field, post

# The quickstart's width (d_model 32), where n_heads 3, 5, 6 and 7 do not divide it.
QUICK: dict[str, Any] = {"model": {"d_model": 32}}
# Every field spelled out: the tree the "every level" and "every leaf" cases walk.
FULL: dict[str, Any] = StudySpec.model_validate(VALID).model_dump(mode="json", by_alias=True)
JSON, YAML = "application/json", "application/yaml"


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of `base` (default VALID) with the '/'-separated `path` set."""
    data = copy.deepcopy(VALID if base is None else base)
    keys: list[Any] = []
    for part in path.split("/"):
        keys.append(int(part) if part.isdigit() else part)
    node: Any = data
    for k in keys[:-1]:
        node = node.setdefault(k, {}) if isinstance(node, dict) else node[k]
    node[keys[-1]] = value
    return data


def space(path: str, param: Any) -> dict[str, Any]:
    return {**VALID, "search_space": {path: param}}


def yaml_bomb(levels: int = 9) -> bytes:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return ("\n".join(lines) + "\nname: bomb\nbudget: {n_trials: 1}\n").encode()


def deep(levels: int, leaf: Any = 1) -> Any:
    v = leaf
    for i in range(levels):
        v = {f"k{i}": v} if i % 2 else [v]
    return v


# (label, body: dict | bytes, content type, status, field named in the errors or None)
Case = tuple[str, Any, str, int, str | None]
CASES: list[Case] = [
    # wrong types and out-of-range values for top-level fields
    ("name int", with_("name", 5), JSON, 422, "name"),
    ("name list", with_("name", ["a"]), JSON, 422, "name"),
    ("name empty", with_("name", ""), JSON, 422, "name"),
    ("name bad chars", with_("name", "../etc/passwd"), JSON, 422, "name"),
    ("name leading dash", with_("name", "-x"), JSON, 422, "name"),
    ("name too long", with_("name", "n" * 201), JSON, 422, "name"),
    ("name null", with_("name", None), JSON, 422, "name"),
    ("description int", with_("description", 7), JSON, 422, "description"),
    ("description too long", with_("description", "d" * 10_001), JSON, 422, "description"),
    ("budget int", with_("budget", 5), JSON, 422, "budget"),
    ("budget list", with_("budget", [5]), JSON, 422, "budget"),
    ("budget empty", with_("budget", {}), JSON, 422, "budget.n_trials"),
    ("n_trials 0", with_("budget/n_trials", 0), JSON, 422, "budget.n_trials"),
    ("n_trials -1", with_("budget/n_trials", -1), JSON, 422, "budget.n_trials"),
    ("n_trials -1e6", with_("budget/n_trials", -1_000_000), JSON, 422, "budget.n_trials"),
    ("n_trials huge", with_("budget/n_trials", 10**12), JSON, 422, "budget.n_trials"),
    ("n_trials enormous", with_("budget/n_trials", 10**30), JSON, 422, "budget.n_trials"),
    ("n_trials fraction", with_("budget/n_trials", 2.5), JSON, 422, "budget.n_trials"),
    ("n_trials word", with_("budget/n_trials", "many"), JSON, 422, "budget.n_trials"),
    ("n_trials null", with_("budget/n_trials", None), JSON, 422, "budget.n_trials"),
    ("timeout 0", with_("budget/timeout_s", 0), JSON, 422, "budget.timeout_s"),
    ("timeout negative", with_("budget/timeout_s", -5), JSON, 422, "budget.timeout_s"),
    ("parallelism 0", with_("parallelism", 0), JSON, 422, "parallelism"),
    ("parallelism -1", with_("parallelism", -1), JSON, 422, "parallelism"),
    ("parallelism 257", with_("parallelism", 257), JSON, 422, "parallelism"),
    ("parallelism word", with_("parallelism", "two"), JSON, 422, "parallelism"),
    ("max_retries -1", with_("max_retries", -1), JSON, 422, "max_retries"),
    ("max_retries 11", with_("max_retries", 11), JSON, 422, "max_retries"),
    # sampler / pruner
    ("sampler kind bogus", with_("sampler/kind", "bogus"), JSON, 422, "sampler.kind"),
    ("sampler kind case", with_("sampler/kind", "TPE"), JSON, 422, "sampler.kind"),
    ("sampler kind int", with_("sampler/kind", 3), JSON, 422, "sampler.kind"),
    ("sampler string", with_("sampler", "tpe"), JSON, 422, "sampler"),
    ("sampler seed -1", with_("sampler/seed", -1), JSON, 422, "sampler.seed"),
    ("sampler seed 2**32", with_("sampler/seed", 2**32), JSON, 422, "sampler.seed"),
    (
        "sampler startup -1",
        with_("sampler/n_startup_trials", -1),
        JSON,
        422,
        "sampler.n_startup_trials",
    ),
    (
        "sampler startup big",
        with_("sampler/n_startup_trials", 10_001),
        JSON,
        422,
        "sampler.n_startup_trials",
    ),
    (
        "grid sampler no grid",
        with_("sampler", {"kind": "grid"}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    ("pruner kind bogus", with_("pruner/kind", "sometimes"), JSON, 422, "pruner.kind"),
    ("pruner percentile 0", with_("pruner/percentile", 0), JSON, 422, "pruner.percentile"),
    ("pruner percentile 100", with_("pruner/percentile", 100), JSON, 422, "pruner.percentile"),
    ("pruner warmup -1", with_("pruner/n_warmup_steps", -1), JSON, 422, "pruner.n_warmup_steps"),
    (
        "pruner with 2 objectives",
        {
            **VALID,
            "pruner": {"kind": "median"},
            "objectives": [
                {"metric": "final_val_loss"},
                {"metric": "min_norm_entropy", "direction": "maximize"},
            ],
        },
        JSON,
        422,
        "pruner",
    ),
    # objectives / constraints
    ("objectives empty", with_("objectives", []), JSON, 422, "objectives"),
    ("objectives not a list", with_("objectives", "final_val_loss"), JSON, 422, "objectives"),
    (
        "objective metric bogus",
        with_("objectives", [{"metric": "accuracy"}]),
        JSON,
        422,
        "objectives.0.metric",
    ),
    (
        "objective metric int",
        with_("objectives", [{"metric": 1}]),
        JSON,
        422,
        "objectives.0.metric",
    ),
    (
        "objective direction",
        with_("objectives", [{"direction": "up"}]),
        JSON,
        422,
        "objectives.0.direction",
    ),
    ("five objectives", with_("objectives", [{}] * 5), JSON, 422, "objectives"),
    (
        "constraint both",
        with_(
            "constraints",
            [{"metric": "min_norm_entropy", "op": ">=", "value": 0.1, "fraction_of_steps": 0.1}],
        ),
        JSON,
        422,
        "constraints.0",
    ),
    (
        "constraint neither",
        with_("constraints", [{"metric": "min_norm_entropy", "op": ">="}]),
        JSON,
        422,
        "constraints.0",
    ),
    ("constraint op", with_("constraints/0/op", "=="), JSON, 422, "constraints.0.op"),
    (
        "constraint metric",
        with_("constraints/0/metric", "vibes"),
        JSON,
        422,
        "constraints.0.metric",
    ),
    (
        "constraint fraction 1.5",
        with_("constraints", [{"metric": "plateau_steps", "op": "<=", "fraction_of_steps": 1.5}]),
        JSON,
        422,
        "constraints.0.fraction_of_steps",
    ),
    ("33 constraints", with_("constraints", VALID["constraints"] * 33), JSON, 422, "constraints"),
    # resources
    ("cpus 0", with_("resources", {"cpus": 0}), JSON, 422, "resources.cpus"),
    ("cpus 300", with_("resources", {"cpus": 300}), JSON, 422, "resources.cpus"),
    ("gpus -1", with_("resources", {"gpus": -1}), JSON, 422, "resources.gpus"),
    ("gpus 17", with_("resources", {"gpus": 17}), JSON, 422, "resources.gpus"),
    # fuse: out of range, or a base config the fused model cannot reproduce
    ("fuse 0", with_("fuse", 0), JSON, 422, "fuse"),
    ("fuse 65", with_("fuse", 65), JSON, 422, "fuse"),
    ("fuse word", with_("fuse", "many"), JSON, 422, "fuse"),
    (
        "fuse with dropout",
        with_("base/model", {"dropout": 0.1}, with_("fuse", 4)),
        JSON,
        422,
        "fuse",
    ),
    # base trial config
    ("base string", with_("base", "default"), JSON, 422, "base"),
    ("steps 0", with_("base/steps", 0), JSON, 422, "base.eval_at_init"),
    ("steps -1", with_("base/steps", -1), JSON, 422, "base.steps"),
    ("steps 1e8", with_("base/steps", 10**8), JSON, 422, "base.steps"),
    ("steps over limit", with_("base/steps", 2_000_000), JSON, 422, "base.steps"),
    ("steps word", with_("base/steps", "lots"), JSON, 422, "base.steps"),
    ("batch 0", with_("base/batch_size", 0), JSON, 422, "base.batch_size"),
    ("batch 5000", with_("base/batch_size", 5000), JSON, 422, "base.batch_size"),
    ("seed -1", with_("base/seed", -1), JSON, 422, "base.seed"),
    ("seed 2**31", with_("base/seed", 2**31), JSON, 422, "base.seed"),
    ("eval_every 0", with_("base/eval_every", 0), JSON, 422, "base.eval_every"),
    ("device tpu", with_("base/device", "tpu"), JSON, 422, "base.device"),
    ("dtype fp8", with_("base/dtype", "fp8"), JSON, 422, "base.dtype"),
    (
        "threshold 2",
        with_("base/entropy_collapse_threshold", 2),
        JSON,
        422,
        "base.entropy_collapse_threshold",
    ),
    ("layers 0", with_("base/model", {"n_layers": 0}), JSON, 422, "base.model.n_layers"),
    ("layers 65", with_("base/model", {"n_layers": 65}), JSON, 422, "base.model.n_layers"),
    ("d_model 3", with_("base/model", {"d_model": 3}), JSON, 422, "base.model.d_model"),
    ("heads do not divide", with_("base/model", {"n_heads": 3}), JSON, 422, "base.model"),
    ("norm sideways", with_("base/model", {"norm": "sideways"}), JSON, 422, "base.model.norm"),
    ("qk_norm bogus", with_("base/model", {"qk_norm": "l3"}), JSON, 422, "base.model.qk_norm"),
    # the model options of issue 34 and the combinations they refuse
    (
        "norm_type bogus",
        with_("base/model", {"norm_type": "batch"}),
        JSON,
        422,
        "base.model.norm_type",
    ),
    (
        "position bogus",
        with_("base/model", {"position": "alibi"}),
        JSON,
        422,
        "base.model.position",
    ),
    (
        "mlp_type bogus",
        with_("base/model", {"mlp_type": "relu2"}),
        JSON,
        422,
        "base.model.mlp_type",
    ),
    (
        "sigma_reparam bogus",
        with_("base/model", {"sigma_reparam": "qk"}),
        JSON,
        422,
        "base.model.sigma_reparam",
    ),
    (
        "rotary with an odd head width",
        with_("base/model", {"position": "rotary", "d_model": 18, "n_heads": 2}),
        JSON,
        422,
        "base.model.position",
    ),
    (
        "sigma_reparam all and on qk",
        with_("base/model", {"sigma_reparam": "all", "qk_norm": "sigma_reparam"}),
        JSON,
        422,
        "base.model.sigma_reparam",
    ),
    (
        "rmsnorm with no norm",
        with_("base/model", {"norm_type": "rmsnorm", "norm": "none"}),
        JSON,
        422,
        "base.model.norm_type",
    ),
    (
        "swiglu with no mlp",
        with_("base/model", {"mlp_type": "swiglu", "mlp": False}),
        JSON,
        422,
        "base.model.mlp_type",
    ),
    (
        "independent decay with sgd",
        with_("base/optim", {"name": "sgd", "weight_decay_mode": "independent"}),
        JSON,
        422,
        "base.optim.weight_decay_mode",
    ),
    ("z_loss_coef negative", with_("base/z_loss_coef", -1e-4), JSON, 422, "base.z_loss_coef"),
    ("z_loss_coef 2", with_("base/z_loss_coef", 2.0), JSON, 422, "base.z_loss_coef"),
    (
        "searched rotary on odd heads",
        {
            **space("model.position", {"type": "categorical", "choices": ["learned", "rotary"]}),
            "base": {"model": {"d_model": 18, "n_heads": 2}},
        },
        JSON,
        422,
        "search_space.model.position",
    ),
    (
        "searched z_loss_coef beyond 1",
        space("z_loss_coef", {"type": "float", "low": 1e-5, "high": 2.0, "log": True}),
        JSON,
        422,
        "search_space.z_loss_coef",
    ),
    ("dropout 1", with_("base/model", {"dropout": 1.0}), JSON, 422, "base.model.dropout"),
    ("qk_init_std 0", with_("base/model", {"qk_init_std": 0}), JSON, 422, "base.model.qk_init_std"),
    ("skip string", with_("base/model", {"skip": "perhaps"}), JSON, 422, "base.model.skip"),
    (
        "model too big",
        with_("base/model", {"n_layers": 64, "d_model": 8192, "n_heads": 64}),
        JSON,
        422,
        "base.model",
    ),
    ("task kind", with_("base/task", {"kind": "chess"}), JSON, 422, "base.task.kind"),
    ("seq_len 2", with_("base/task", {"seq_len": 2}), JSON, 422, "base.task.seq_len"),
    ("lr 0", with_("base/optim", {"lr": 0}), JSON, 422, "base.optim.lr"),
    ("lr 11", with_("base/optim", {"lr": 11}), JSON, 422, "base.optim.lr"),
    ("optim name", with_("base/optim", {"name": "adam"}), JSON, 422, "base.optim.name"),
    ("beta1 1", with_("base/optim", {"beta1": 1.0}), JSON, 422, "base.optim.beta1"),
    ("grad_clip 0", with_("base/optim", {"grad_clip": 0}), JSON, 422, "base.optim.grad_clip"),
    (
        "warmup > steps",
        with_("base", {"steps": 5, "optim": {"warmup_steps": 10}}),
        JSON,
        422,
        "base",
    ),
    ("lambda -1", with_("base/regularizer", {"lambda": -1}), JSON, 422, "base.regularizer.lambda"),
    (
        "regularizer kind",
        with_("base/regularizer", {"kind": "magic"}),
        JSON,
        422,
        "base.regularizer.kind",
    ),
    # unknown fields at several levels (the walk below adds one at every level)
    ("unknown top", with_("colour", "red"), JSON, 422, "colour"),
    ("unknown model", with_("base/model", {"n_layer": 2}), JSON, 422, "base.model.n_layer"),
    ("unknown budget", with_("budget/trials", 3), JSON, 422, "budget.trials"),
    (
        "regularizer lam alias",
        with_("base/regularizer", {"lambda_": 0.1}),
        JSON,
        422,
        "base.regularizer.lambda_",
    ),
    # search space
    ("space not a mapping", with_("search_space", ["optim.lr"]), JSON, 422, "search_space"),
    (
        "path unknown leaf",
        space("model.nope", {"type": "fixed", "value": 1}),
        JSON,
        422,
        "search_space.model.nope",
    ),
    (
        "path unknown section",
        space("nope.lr", {"type": "fixed", "value": 1}),
        JSON,
        422,
        "search_space.nope.lr",
    ),
    (
        "path is a section",
        space("model", {"type": "fixed", "value": 1}),
        JSON,
        422,
        "search_space.model",
    ),
    (
        "path too deep",
        space("model.norm.x", {"type": "fixed", "value": 1}),
        JSON,
        422,
        "search_space.model.norm.x",
    ),
    ("path empty", space("", {"type": "fixed", "value": 1}), JSON, 422, "search_space"),
    (
        "path dots",
        space("model..norm", {"type": "fixed", "value": "pre"}),
        JSON,
        422,
        "search_space",
    ),
    (
        "path python name",
        space("regularizer.lam", {"type": "float", "low": 0.1, "high": 1.0}),
        JSON,
        422,
        "search_space.regularizer.lam",
    ),
    ("param not a mapping", space("optim.lr", 0.01), JSON, 422, "search_space.optim.lr"),
    (
        "param no type",
        space("optim.lr", {"low": 0.1, "high": 1.0}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "param bad type",
        space("optim.lr", {"type": "double", "low": 0.1, "high": 1.0}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "float low == high",
        space("optim.lr", {"type": "float", "low": 0.1, "high": 0.1}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "float low > high",
        space("optim.lr", {"type": "float", "low": 0.1, "high": 0.01}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "int low > high",
        space("model.n_layers", {"type": "int", "low": 4, "high": 2}),
        JSON,
        422,
        "search_space.model.n_layers",
    ),
    (
        "float log low 0",
        space("optim.lr", {"type": "float", "low": 0, "high": 0.1, "log": True}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "float log low < 0",
        space("base.x", {"type": "float", "low": -1, "high": 0.1, "log": True}),
        JSON,
        422,
        "search_space.base.x",
    ),
    (
        "int log low 0",
        space("model.n_layers", {"type": "int", "low": 0, "high": 4, "log": True}),
        JSON,
        422,
        "search_space.model.n_layers",
    ),
    (
        "int step 0",
        space("model.n_layers", {"type": "int", "low": 1, "high": 4, "step": 0}),
        JSON,
        422,
        "search_space.model.n_layers",
    ),
    (
        "int fractional bound",
        space("model.n_layers", {"type": "int", "low": 1.5, "high": 4}),
        JSON,
        422,
        "search_space.model.n_layers",
    ),
    (
        "empty choices",
        space("model.norm", {"type": "categorical", "choices": []}),
        JSON,
        422,
        "search_space.model.norm",
    ),
    (
        "choices not a list",
        space("model.norm", {"type": "categorical", "choices": "pre"}),
        JSON,
        422,
        "search_space.model.norm",
    ),
    (
        "choice is a mapping",
        space("model.norm", {"type": "categorical", "choices": [{"a": 1}]}),
        JSON,
        422,
        "search_space.model.norm",
    ),
    (
        "choice invalid for field",
        space("model.norm", {"type": "categorical", "choices": ["pre", "sideways"]}),
        JSON,
        422,
        "search_space.model.norm",
    ),
    (
        "range outside field",
        space("model.dropout", {"type": "float", "low": 0.1, "high": 1.5}),
        JSON,
        422,
        "search_space.model.dropout",
    ),
    (
        "fixed no value",
        space("model.norm", {"type": "fixed"}),
        JSON,
        422,
        "search_space.model.norm",
    ),
    (
        "grid empty",
        space("optim.lr", {"type": "float", "low": 0.001, "high": 0.1, "grid": []}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "grid too long",
        space("optim.lr", {"type": "float", "low": 0.001, "high": 0.1, "grid": [0.01] * 1001}),
        JSON,
        422,
        "search_space.optim.lr",
    ),
    (
        "grid value invalid",
        space("model.n_layers", {"type": "int", "low": 1, "high": 4, "grid": [99]}),
        JSON,
        422,
        "search_space.model.n_layers",
    ),
    (
        "param unknown key",
        space("optim.lr", {"type": "float", "low": 0.1, "high": 1.0, "logg": True}),
        JSON,
        422,
        "search_space.optim.lr.logg",
    ),
    (
        "65 parameters",
        with_("search_space", {f"p{i}": {"type": "fixed", "value": i} for i in range(65)}),
        JSON,
        422,
        "search_space",
    ),
    (
        "steps search too big",
        space("steps", {"type": "int", "low": 10, "high": 5_000_000}),
        JSON,
        422,
        "base.steps",
    ),
    (
        "d_model search too big",
        {
            **VALID,
            "search_space": {
                "model.d_model": {"type": "categorical", "choices": [64, 8192]},
                "model.n_layers": {"type": "int", "low": 1, "high": 64},
            },
        },
        JSON,
        422,
        "base.model",
    ),
    # points inside the search space that are not valid trial configs (issue 27, item 3):
    # each endpoint alone is valid, so only an enumeration of the space finds them
    (
        "heads inside the range do not divide d_model",
        {**space("model.n_heads", {"type": "int", "low": 1, "high": 8}), "base": QUICK},
        JSON,
        422,
        "search_space.model.n_heads",
    ),
    (
        "searched warmup past searched steps",
        with_(
            "search_space",
            {
                "steps": {"type": "int", "low": 10, "high": 500},
                "optim.warmup_steps": {"type": "int", "low": 0, "high": 100},
            },
        ),
        JSON,
        422,
        "search_space.optim.warmup_steps",
    ),
    (
        "searched d_model and n_heads that do not divide together",
        with_(
            "search_space",
            {
                "model.d_model": {"type": "categorical", "choices": [64, 96]},
                "model.n_heads": {"type": "categorical", "choices": [2, 64]},
            },
        ),
        JSON,
        422,
        "search_space.model.n_heads",
    ),
    (
        "grid of heads against a grid of widths",
        {
            **with_(
                "search_space",
                {
                    "model.d_model": {"type": "int", "low": 64, "high": 96, "grid": [64, 96]},
                    "model.n_heads": {"type": "int", "low": 1, "high": 64, "grid": [1, 64]},
                },
            ),
            "sampler": {"kind": "grid"},
        },
        JSON,
        422,
        "search_space.model.n_heads",
    ),
    (
        "float range over an int field",
        space("steps", {"type": "float", "low": 100, "high": 200}),
        JSON,
        422,
        "search_space.steps",
    ),
    (
        "int log with step 2",
        space("model.n_layers", {"type": "int", "low": 1, "high": 8, "log": True, "step": 2}),
        JSON,
        422,
        "search_space.model.n_layers",
    ),
    (
        "searched pairs outgrow a searched seq_len",
        with_(
            "search_space",
            {
                "task.n_pairs": {"type": "int", "low": 1, "high": 12},
                "task.seq_len": {"type": "int", "low": 20, "high": 64},
            },
        ),
        JSON,
        422,
        "search_space.task.seq_len",
    ),
    # memory one worker cannot hold (QKSCOPE_MAX_TRIAL_MEMORY_BYTES, 16 GiB by default)
    (
        "activations: batch x heads x seq_len^2",
        with_("base", {"batch_size": 512, "task": {"seq_len": 2048}}),
        JSON,
        422,
        "base.batch_size",
    ),
    (
        "a searched validation set",
        {
            **with_("base", {"batch_size": 8, "task": {"seq_len": 4096}}),
            "search_space": {"task.n_valid": {"type": "int", "low": 1000, "high": 100_000}},
        },
        JSON,
        422,
        "search_space.task.n_valid",
    ),
    (
        "a searched vocabulary",
        {
            **with_(
                "base",
                {"batch_size": 64, "task": {"kind": "lm", "data_dir": "c", "seq_len": 512}},
            ),
            "search_space": {
                "task.vocab_cap": {"type": "int", "low": 1000, "high": 1_000_000, "log": True}
            },
        },
        JSON,
        422,
        "search_space.task.vocab_cap",
    ),
    (
        "fused members that fit one by one",
        {
            **with_(
                "base",
                {"batch_size": 64, "task": {"seq_len": 1024}, "model": {"n_heads": 8}},
            ),
            "fuse": 8,
        },
        JSON,
        422,
        "fuse",
    ),
    # bodies that are not a mapping
    ("json list", b"[1, 2]", JSON, 422, "body"),
    ("json string", b'"study"', JSON, 422, "body"),
    ("json number", b"42", JSON, 422, "body"),
    ("json null", b"null", JSON, 422, "body"),
    ("json true", b"true", JSON, 422, "body"),
    ("yaml scalar", b"just words\n", YAML, 422, "body"),
    ("yaml list", b"- name: t\n- budget: {n_trials: 1}\n", YAML, 422, "body"),
    ("yaml empty", b"", YAML, 422, "body"),
    ("yaml comment only", b"# nothing\n", YAML, 422, "body"),
    ("yaml int keys", b"1: 2\n3: 4\n", YAML, 422, None),
    ("yaml date name", b"name: 2024-01-01\nbudget: {n_trials: 1}\n", YAML, 422, "name"),
    # YAML features that are refused
    ("yaml alias bomb", yaml_bomb(), YAML, 422, "body"),
    ("yaml small alias", b"x: &n 3\nname: t\nbudget: {n_trials: *n}\n", YAML, 422, "body"),
    ("yaml merge key", b"d: &d {n_trials: 1}\nname: t\nbudget: {<<: *d}\n", YAML, 422, "body"),
    (
        "yaml python tag",
        b'name: !!python/object/apply:os.system ["true"]\nbudget: {n_trials: 1}\n',
        YAML,
        400,
        "body",
    ),
    ("yaml two documents", b"name: t\n---\nbudget: {n_trials: 1}\n", YAML, 400, "body"),
    ("yaml unhashable key", b"? [1, 2]\n: 3\n", YAML, 400, "body"),
    ("yaml broken", b"name: [unclosed\n", YAML, 400, "body"),
    ("yaml tab indent", b"name: t\nbudget:\n\tn_trials: 1\n", YAML, 400, "body"),
    # unparseable JSON
    ("json truncated", b'{"name": "t", "budget": {', JSON, 400, "body"),
    ("json single quotes", b"{'name': 't'}", JSON, 400, "body"),
    ("json trailing comma", b'{"name": "t",}', JSON, 400, "body"),
    ("json empty", b"", JSON, 400, "body"),
    ("json two values", b"{} {}", JSON, 400, "body"),
    # deeply nested junk (within what the parsers handle)
    ("nested junk unknown key", with_("junk", deep(100)), JSON, 422, "junk"),
    ("nested junk in name", with_("name", deep(100)), JSON, 422, "name"),
    (
        "nested junk in choices",
        space("model.norm", {"type": "categorical", "choices": [deep(50)]}),
        JSON,
        422,
        "search_space.model.norm",
    ),
    (
        "nested junk yaml",
        ("name: t\nbudget: {n_trials: 1}\njunk: " + json.dumps(deep(40)) + "\n").encode(),
        YAML,
        422,
        "junk",
    ),
    # bytes that are not UTF-8
    ("latin-1 yaml", "name: café\nbudget: {n_trials: 1}\n".encode("latin-1"), YAML, 400, "body"),
    (
        "latin-1 json",
        '{"name": "café", "budget": {"n_trials": 1}}'.encode("latin-1"),
        JSON,
        400,
        "body",
    ),
    ("utf-16 json", json.dumps(VALID).encode("utf-16"), JSON, 400, "body"),
    ("random bytes", bytes(range(128, 256)), JSON, 400, "body"),
    (
        "lone surrogate bytes",
        b'{"name": "\xed\xa0\x80", "budget": {"n_trials": 1}}',
        JSON,
        400,
        "body",
    ),
    (
        "escaped lone surrogate",
        b'{"name": "ok", "description": "\\ud800", "budget": {"n_trials": 1}}',
        JSON,
        422,
        "description",
    ),
    # transport-level problems
    ("xml", b"<study><name>t</name></study>", "application/xml", 415, None),
    ("form", b"name=t&budget=1", "application/x-www-form-urlencoded", 415, None),
    ("too large", with_("description", "x" * 300_000), JSON, 413, None),
]


def _walk(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))


def _set(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = copy.deepcopy(data)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


MAPPINGS = [p for p, v in _walk(FULL) if isinstance(v, dict)]
LEAVES = [p for p, v in _walk(FULL) if not isinstance(v, dict | list)]
# An unknown field at every level of the definition (in search_space it is an unknown path).
CASES += [
    (
        f"unknown at {_dotted(p) or 'top'}",
        _set(FULL, (*p, "zz_unknown"), 1) if p else {**FULL, "zz_unknown": 1},
        JSON,
        422,
        _dotted((*p, "zz_unknown")),
    )
    for p in MAPPINGS
]
# A mapping where every leaf (string, number, bool, null) should be.
CASES += [
    (
        f"mapping at {_dotted(p)}",
        _set(FULL, p, {"junk": [1, 2]}),
        JSON,
        422,
        _dotted(p[:-1] if p[-1] == "type" else p),
    )
    for p in LEAVES
]
assert len(CASES) >= 100


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_db(module_db_url: str) -> str:
    return module_db_url


@pytest.fixture(scope="module")
def app_client(bad_db: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    s = Settings(
        database_url=bad_db, ray_address="", api_tokens="", home=tmp_path_factory.mktemp("h")
    )
    with TestClient(create_app(s, reconcile_loop=False), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def engine(app_client: TestClient, bad_db: str) -> Iterator[Engine]:
    eng = make_engine(bad_db)
    yield eng
    eng.dispose()


# --- the table ----------------------------------------------------------------------------------


def test_every_bad_definition_is_a_4xx_naming_its_field_and_writes_nothing(
    app_client: TestClient, engine: Engine
) -> None:
    assert n_studies(engine) == 0
    failures = []
    for label, body, ctype, status, field in CASES:
        out = check_rejected(app_client, body, ctype, label)
        if out["status"] != status:
            failures.append((label, "status", status, out["status"], out["message"][:200]))
        elif field is not None and not names_field(out, field):
            failures.append(
                (label, "field", field, [e["field"] for e in out["errors"]], out["message"][:200])
            )
    assert not failures, "\n".join(map(str, failures))
    assert n_studies(engine) == 0


def test_the_valid_base_definition_is_accepted() -> None:
    """Guard: the cases above fail for their own reason, not because VALID is broken."""
    spec = StudySpec.model_validate(VALID)
    assert spec.search_space and spec.constraints
    StudySpec.model_validate(FULL)
    # The fuse cases fail for the base config, not for fuse itself: a fusable base passes.
    assert StudySpec.model_validate(with_("fuse", 4)).fuse == 4
    # sigma-reparam (query/key or every layer) is fused since issue 34: fuse 4 accepted
    for model in ({"qk_norm": "sigma_reparam"}, {"sigma_reparam": "all"}):
        assert StudySpec.model_validate(with_("base/model", model, with_("fuse", 4))).fuse == 4
    # every model option of issue 34 at once, and z-loss searched over its usual range
    llama = {"norm_type": "rmsnorm", "qk_norm": "rmsnorm", "position": "rotary",
             "mlp_type": "swiglu", "sigma_reparam": "all"}  # fmt: skip
    searched = with_(
        "search_space",
        {"z_loss_coef": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True}},
        with_("base/optim", {"weight_decay_mode": "independent"}, with_("base/model", llama)),
    )
    assert StudySpec.model_validate(searched).base.model.position == "rotary"
    # ... and the default (fuse: auto) accepts an unfusable base, without fusing it
    unfusable = StudySpec.model_validate(with_("base/model", {"dropout": 0.1}))
    assert unfusable.fuse == "auto" and unfusable.slots == 1


def test_a_search_space_point_that_fails_is_named_with_its_value(
    app_client: TestClient, engine: Engine
) -> None:
    """Issue 27, item 3: the quickstart's d_model 32 with n_heads searched over 1..8 was
    accepted (201) and failed the whole study when Optuna suggested 3. Now: a 422 naming the
    parameter and a value that fails, nothing stored; the same space without the bad values,
    and ranges whose every point is valid, are accepted."""
    body = {**space("model.n_heads", {"type": "int", "low": 1, "high": 8}), "base": QUICK}
    out = check_rejected(app_client, body, JSON)
    assert out["status"] == 422, out
    assert [e["field"] for e in out["errors"]] == ["search_space.model.n_heads"], out
    assert "model.n_heads=3" in out["errors"][0]["message"], out
    assert "divisible" in out["errors"][0]["message"], out
    warm = {
        "steps": {"type": "int", "low": 10, "high": 500},
        "optim.warmup_steps": {"type": "int", "low": 0, "high": 100},
    }
    out = check_rejected(app_client, with_("search_space", warm), JSON)
    assert "steps=10, optim.warmup_steps=11" in out["errors"][0]["message"], out
    assert n_studies(engine) == 0
    good = [
        {**space("model.n_heads", {"type": "categorical", "choices": [1, 2, 4, 8]}), "base": QUICK},
        {**space("model.n_heads", {"type": "int", "low": 1, "high": 2}), "base": QUICK},
        with_("search_space", {**warm, "steps": {"type": "int", "low": 100, "high": 500}}),
    ]
    try:
        for b in good:
            r = post(app_client, b, JSON)
            assert r.status_code == 201, r.text
    finally:
        with engine.begin() as conn:  # keep the table empty for the tests after this one
            conn.execute(text("DELETE FROM qk_study"))


def test_memory_beyond_the_worker_limit_is_a_422_and_the_limit_is_a_setting(
    db_url: str, tmp_path: Path
) -> None:
    """Issue 27: only parameters were bounded; a validation set of n_valid x seq_len (~16 GB
    at the field maxima) or a batch's attention maps were accepted and ran a worker out of
    memory. The worst point's estimate against QKSCOPE_MAX_TRIAL_MEMORY_BYTES."""
    body = {
        **with_("base", {"batch_size": 8, "task": {"seq_len": 4096}}),
        "search_space": {"task.n_valid": {"type": "int", "low": 1000, "high": 100_000}},
    }
    small = Settings(database_url=db_url, ray_address="", api_tokens="", home=tmp_path)
    with TestClient(create_app(small, reconcile_loop=False), raise_server_exceptions=False) as c:
        out = check_rejected(c, body, JSON)
    assert out["status"] == 422 and out["error"] == "limit_exceeded", out
    msg = out["errors"][0]["message"]
    assert "task.n_valid=100000" in msg and "QKSCOPE_MAX_TRIAL_MEMORY_BYTES" in msg, msg
    assert "validation 15.3 GiB" in msg, msg
    engine = make_engine(db_url)
    try:
        assert n_studies(engine) == 0
        big = small.model_copy(update={"max_trial_memory_bytes": 64 * 2**30})
        with TestClient(create_app(big, reconcile_loop=False)) as c:
            assert post(c, body, JSON).status_code == 201
    finally:
        engine.dispose()


# --- generated junk ---------------------------------------------------------------------------

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
junk = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)
containers = st.lists(junk, min_size=1, max_size=3) | st.dictionaries(
    st.text(max_size=5), junk, min_size=1, max_size=3
)


@SETTINGS
@given(value=junk, ctype=st.sampled_from([JSON, YAML]))
def test_generated_junk_bodies_are_rejected(
    app_client: TestClient, engine: Engine, value: Any, ctype: str
) -> None:
    assume(not (isinstance(value, dict) and "budget" in value and "name" in value))
    check_rejected(app_client, value, ctype)
    assert n_studies(engine) == 0


@SETTINGS
@given(leaf=st.sampled_from(LEAVES), value=containers)
def test_containers_in_place_of_any_leaf_name_the_leaf(
    app_client: TestClient, engine: Engine, leaf: tuple[Any, ...], value: Any
) -> None:
    out = check_rejected(app_client, _set(FULL, leaf, value), JSON)
    assert out["status"] == 422
    want = _dotted(leaf[:-1] if leaf[-1] == "type" else leaf)
    assert names_field(out, want), (want, out)
    assert n_studies(engine) == 0


@SETTINGS
@given(at=st.sampled_from(MAPPINGS), key=st.text(min_size=1, max_size=12), value=junk)
def test_unknown_keys_at_any_level_are_named(
    app_client: TestClient, engine: Engine, at: tuple[Any, ...], key: str, value: Any
) -> None:
    key = "zz" + key
    data = _set(FULL, (*at, key), value) if at else {**FULL, key: value}
    out = check_rejected(app_client, data, JSON)
    assert out["status"] == 422
    assert names_field(out, _dotted((*at, key))), out
    assert n_studies(engine) == 0


@SETTINGS
@given(raw=st.binary(max_size=200), ctype=st.sampled_from([JSON, YAML, "text/plain"]))
def test_random_bytes_are_rejected(
    app_client: TestClient, engine: Engine, raw: bytes, ctype: str
) -> None:
    check_rejected(app_client, raw, ctype)
    assert n_studies(engine) == 0


@SETTINGS
@given(doc=st.text(max_size=200))
def test_random_yaml_text_is_rejected(app_client: TestClient, engine: Engine, doc: str) -> None:
    check_rejected(app_client, doc.encode(), YAML)
    assert n_studies(engine) == 0


# --- bugs found by these tests (500s or stored junk), now fixed; kept as regressions ----------------------------


def _refused_cases(
    app_client: TestClient, engine: Engine, cases: list[tuple[str, bytes, str]]
) -> None:
    try:
        bad = []
        for label, body, ctype in cases:
            r = post(app_client, body, ctype)
            if not 400 <= r.status_code < 500:
                bad.append((label, r.status_code))
        assert not bad, bad
        assert n_studies(engine) == 0
    finally:
        with engine.begin() as conn:  # keep the table empty for the tests after this one
            conn.execute(text("DELETE FROM qk_study"))


def test_deeply_nested_bodies_are_client_errors(app_client: TestClient, engine: Engine) -> None:
    n = 2000  # past the default recursion limit of 1000
    _refused_cases(
        app_client,
        engine,
        [
            (
                "json",
                b'{"name": "t", "budget": {"n_trials": 1}, "junk": ' + b"[" * n + b"]" * n + b"}",
                JSON,
            ),
            (
                "yaml",
                b"name: t\nbudget: {n_trials: 1}\njunk: " + b"[" * 500 + b"]" * 500 + b"\n",
                YAML,
            ),
        ],
    )


def test_nested_yaml_is_refused_before_parsing(tmp_path: Path) -> None:
    """A deeply nested YAML body is refused by the nesting check that runs before any parser
    (the check that keeps it cheap), not by a parser that got deep into it."""
    s = Settings(
        database_url=f"sqlite:///{tmp_path / 'q.db'}", ray_address="", api_tokens="", home=tmp_path
    )
    with TestClient(create_app(s, reconcile_loop=False), raise_server_exceptions=False) as c:
        body = b"junk: " + b"[" * 2000 + b"]" * 2000 + b"\n"
        r = post(c, body, YAML)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == ["body"]
    assert "nested deeper than" in errors[0]["message"]


def test_giant_integer_literals_are_client_errors(app_client: TestClient, engine: Engine) -> None:
    digits = b"1" * 5000
    _refused_cases(
        app_client,
        engine,
        [
            ("json", b'{"name": "t", "budget": {"n_trials": ' + digits + b"}}", JSON),
            ("yaml", b"name: t\nbudget: {n_trials: " + digits + b"}\n", YAML),
        ],
    )


def test_non_finite_numbers_are_client_errors(app_client: TestClient, engine: Engine) -> None:
    _refused_cases(
        app_client,
        engine,
        [
            (
                "json Infinity timeout",
                b'{"name": "t", "budget": {"n_trials": 1, "timeout_s": Infinity}}',
                JSON,
            ),
            (
                "json NaN constraint",
                b'{"name": "t", "budget": {"n_trials": 1}, "constraints": '
                b'[{"metric": "final_val_loss", "op": "<=", "value": NaN}]}',
                JSON,
            ),
            ("yaml .inf timeout", b"name: t\nbudget: {n_trials: 1, timeout_s: .inf}\n", YAML),
            (
                "yaml .inf high",
                b"name: t\nbudget: {n_trials: 1}\nsearch_space:\n"
                b"  trapped_rel_gap: {type: float, low: 0.1, high: .inf}\n",
                YAML,
            ),
        ],
    )


def test_string_step_choices_are_client_errors(app_client: TestClient, engine: Engine) -> None:
    body = {
        **VALID,
        "search_space": {"steps": {"type": "categorical", "choices": ["100.0", "200"]}},
    }
    # pydantic reads "100.0" as 100 steps, so the spec is valid: it must be accepted, not a 500.
    r = post(app_client, json.dumps(body).encode(), JSON)
    assert r.status_code == 201, r.text
    with engine.begin() as conn:  # keep the table empty for the tests after this one
        conn.execute(text("DELETE FROM qk_study"))


# --- booleans for numbers ---------------------------------------------------------------------

# Every number of the definition, all spelled out (budget.n_trials, base.steps, the search
# space's bounds, constraint values, ...): pydantic's lax mode would read true as 1.
NUMBER_LEAVES = [
    p for p, v in _walk(FULL) if isinstance(v, int | float) and not isinstance(v, bool)
]


def test_a_boolean_for_any_number_is_a_422_naming_it(
    app_client: TestClient, engine: Engine
) -> None:
    assert ("budget", "n_trials") in NUMBER_LEAVES and len(NUMBER_LEAVES) > 20
    failures = []
    for p in NUMBER_LEAVES:
        for flag in (True, False):
            out = check_rejected(app_client, _set(FULL, p, flag), JSON, _dotted(p))
            # A bound read as 1.0/0.0 can first break the parameter's low < high rule,
            # which names the parameter (search_space.<path>).
            named = names_field(out, _dotted(p)) or (
                p[0] == "search_space" and names_field(out, _dotted(p[:2]))
            )
            if out["status"] != 422 or not named:
                failures.append((_dotted(p), flag, out["status"], out["message"][:200]))
    assert not failures, "\n".join(map(str, failures))
    out = check_rejected(app_client, b"name: t\nbudget: {n_trials: true}\n", YAML)
    assert out["status"] == 422 and [e["field"] for e in out["errors"]] == ["budget.n_trials"]
    assert n_studies(engine) == 0


# --- a large body sent at once ----------------------------------------------------------------


def test_a_6mb_body_sent_without_expect_continue_gets_the_413_json(
    bad_db: str, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """urllib sends the whole body before reading (no `Expect: 100-continue`): it must read
    the 413 JSON, not a connection reset. The keep-alive connection also still works."""
    import urllib.error
    import urllib.request

    from tests.service.conftest import live_api

    settings = Settings(database_url=bad_db, ray_address="", api_tokens="", home=tmp_path)
    body = json.dumps({**VALID, "description": "x" * (6 * 1024 * 1024)}).encode()
    with live_api(settings, monkeypatch) as url:
        req = urllib.request.Request(
            f"{url}/v1/studies", data=body, headers={"Content-Type": JSON}, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 413
        out = json.loads(e.value.read())
        assert (
            out["error"] == "payload_too_large" and str(settings.max_body_bytes) in out["message"]
        )
        # The same size in chunks (no Content-Length) is refused the same way.
        chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
        req = urllib.request.Request(
            f"{url}/v1/studies",
            data=chunks,
            headers={"Content-Type": JSON, "Transfer-Encoding": "chunked"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 413
    assert n_studies(engine) == 0


# --- task.data_dir stays inside QKSCOPE_DATA_DIR ---------------------------------------------


def test_data_dir_outside_the_data_root_is_a_422_that_reveals_nothing(
    db_url: str, tmp_path: Path
) -> None:
    """Issue 27: `task.data_dir` could name any directory of the workers (absolute, `~`,
    `..`, a symlink out of QKSCOPE_DATA_DIR), and the error told whether it existed. Now
    each is a 422 naming the field, with one message whatever exists outside; nothing is
    stored; a corpus inside the root is accepted."""
    root = tmp_path / "data"
    (root / "corpus").mkdir(parents=True)
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "exit").symlink_to(outside)  # an existing directory outside
    (root / "dangling").symlink_to(tmp_path / "nowhere")  # a missing one
    (root / "inner").symlink_to(root / "corpus")  # a symlink that stays inside is fine
    settings = Settings(
        database_url=db_url, ray_address="", api_tokens="", home=tmp_path, data_dir=str(root)
    )

    def lm(data_dir: str) -> dict[str, Any]:
        task = {"kind": "lm", "data_dir": data_dir, "tokenizer": "char", "vocab_cap": 256}
        return {**VALID, "base": {"task": task}}

    escapes = [
        str(outside),
        "/nonexistent/really",
        "~",
        "~root/x",
        "../secret",
        "corpus/../../secret",
        "corpus/../../nowhere",
        "exit",
        "exit/sub",
        "dangling",
        "corpus\\..\\..\\secret",
    ]
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        engine = make_engine(db_url)
        try:
            messages = set()
            for bad in escapes:
                out = check_rejected(c, lm(bad), JSON, bad)
                assert out["status"] == 422, (bad, out)
                assert [e["field"] for e in out["errors"]] == ["base.task.data_dir"], (bad, out)
                assert str(tmp_path) not in out["message"], out
                messages.add(out["message"])
            assert len(messages) == 1, messages  # existing or not, inside a link or not
            searched = {
                **lm("corpus"),
                "search_space": {
                    "task.data_dir": {"type": "categorical", "choices": ["corpus", "/etc"]}
                },
            }
            out = check_rejected(c, searched, JSON)
            assert [e["field"] for e in out["errors"]] == ["search_space.task.data_dir"], out
            assert n_studies(engine) == 0
            for good in ("corpus", "inner", "corpus/sub", "not-there-yet"):
                r = post(c, lm(good), JSON)
                assert r.status_code == 201, (good, r.text)
        finally:
            engine.dispose()


# --- model.causal: false where the targets are later inputs ----------------------------------


def test_bidirectional_language_modelling_is_a_422_naming_model_causal(
    app_client: TestClient, engine: Engine
) -> None:
    """Nothing refused `model.causal: false` on the lm task, whose targets are its inputs
    shifted by one: bidirectional attention sees each answer. Now a 422 naming model.causal
    and the task, in the base and as a searched value, and nothing is stored."""
    lm = {"kind": "lm", "data_dir": "wikitext-2", "tokenizer": "char", "vocab_cap": 256}
    in_base = {**VALID, "base": {"task": lm, "model": {"causal": False}}}
    out = check_rejected(app_client, in_base, JSON)
    assert out["status"] == 422, out
    assert [e["field"] for e in out["errors"]] == ["base.model.causal"], out
    assert names_field(out, "model.causal") and "'lm'" in out["errors"][0]["message"], out
    searched = {
        **VALID,
        "base": {"task": lm},
        "search_space": {"model.causal": {"type": "categorical", "choices": [True, False]}},
    }
    out = check_rejected(app_client, searched, JSON)
    assert out["status"] == 422, out
    assert [e["field"] for e in out["errors"]] == ["search_space.model.causal"], out
    assert "'lm'" in out["errors"][0]["message"], out
    assert n_studies(engine) == 0
