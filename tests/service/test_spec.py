"""StudySpec validation: field paths in errors, search-space checks against the trial config."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.spec import SpecError, StudySpec, apply_params, check_limits, parse_spec

BASE = {"name": "t", "budget": {"n_trials": 2}}


def errors_of(data: dict) -> list[str]:
    with pytest.raises(ValidationError) as e:
        StudySpec.model_validate(data)
    return [".".join(str(x) for x in err["loc"]) + ": " + err["msg"] for err in e.value.errors()]


def test_minimal_spec_fills_defaults() -> None:
    spec = StudySpec.model_validate(BASE)
    assert spec.parallelism == 1 and spec.objectives[0].metric == "final_val_loss"
    assert spec.base.task.kind == "associative_recall"


def test_unknown_field_is_rejected_with_its_path() -> None:
    msgs = errors_of({**BASE, "base": {"model": {"n_layer": 3}}})
    assert any(m.startswith("base.model.n_layer") for m in msgs), msgs


def test_search_space_path_must_exist() -> None:
    msgs = errors_of({**BASE, "search_space": {"model.nope": {"type": "fixed", "value": 1}}})
    assert any("search_space.model.nope" in m for m in msgs), msgs


def test_search_space_bounds_checked_against_trial_config_limits() -> None:
    space = {"model.qk_init_std": {"type": "float", "low": 0.1, "high": 50.0}}
    msgs = errors_of({**BASE, "search_space": space})
    assert any("search_space.model.qk_init_std" in m and "10" in m for m in msgs), msgs


def test_mlp_init_std_is_in_the_schema_searchable_bounded_and_fusable() -> None:
    """`model.mlp_init_std` (Dong et al.'s MLP scale): a per-member init scale."""
    assert "mlp_init_std" in StudySpec.model_json_schema()["$defs"]["ModelConfig"]["properties"]
    grid = {"type": "float", "low": 0.02, "high": 0.5, "grid": [0.02, 0.125, 0.5]}
    spec = StudySpec.model_validate(
        {
            **BASE,
            "fuse": 3,
            "sampler": {"kind": "grid"},
            "search_space": {"model.mlp_init_std": grid},
        }
    )
    assert apply_params(spec.base, {"model.mlp_init_std": 0.5}).model.mlp_init_std == 0.5
    space = {"model.mlp_init_std": {"type": "float", "low": 0.02, "high": 2.0}}
    msgs = errors_of({**BASE, "search_space": space})
    assert any("search_space.model.mlp_init_std" in m for m in msgs), msgs


def test_low_must_be_below_high_and_log_positive() -> None:
    space = {"optim.lr": {"type": "float", "low": 0.1, "high": 0.01}}
    assert any("low" in m for m in errors_of({**BASE, "search_space": space}))
    space = {"optim.lr": {"type": "float", "low": 0.0, "high": 0.01, "log": True}}
    assert any("log" in m for m in errors_of({**BASE, "search_space": space}))


def test_pruner_needs_single_objective() -> None:
    data = {
        **BASE,
        "pruner": {"kind": "median"},
        "objectives": [
            {"metric": "final_val_loss"},
            {"metric": "min_norm_entropy", "direction": "maximize"},
        ],
    }
    assert any("single objective" in m for m in errors_of(data))


def test_grid_sampler_needs_grid_values() -> None:
    data = {
        **BASE,
        "sampler": {"kind": "grid"},
        "search_space": {"optim.lr": {"type": "float", "low": 0.001, "high": 0.01}},
    }
    assert any("grid" in m for m in errors_of(data))


def test_apply_params_sets_dotted_fields_and_aliases() -> None:
    spec = StudySpec.model_validate(BASE)
    cfg = apply_params(spec.base, {"regularizer.lambda": 0.5, "model.n_layers": 3})
    assert cfg.regularizer.lam == 0.5 and cfg.model.n_layers == 3
    with pytest.raises(SpecError) as e:
        apply_params(spec.base, {"model.n_heads": 3})  # 64 not divisible by 3
    assert "model" in e.value.field


def test_constraint_violation_follows_optuna_convention() -> None:
    spec = StudySpec.model_validate({**BASE, "constraints": [
        {"metric": "min_norm_entropy", "op": ">=", "value": 0.1},
        {"metric": "plateau_steps", "op": "<=", "fraction_of_steps": 0.2},
    ]})  # fmt: skip
    ge, le = spec.constraints
    assert ge.violation({"min_norm_entropy": 0.3}, 100) == pytest.approx(-0.2)
    assert ge.violation({"min_norm_entropy": 0.05}, 100) == pytest.approx(0.05)
    assert le.violation({"plateau_steps": 30}, 100) == pytest.approx(10.0)
    assert ge.violation({}, 100) > 0  # missing metric is infeasible


def test_limits_name_the_field() -> None:
    spec = StudySpec.model_validate({**BASE, "budget": {"n_trials": 50}, "base": {"steps": 5000}})
    errs = check_limits(spec, max_trials=10, max_steps=1000, max_params=10**9)
    assert {e.field for e in errs} == {"budget.n_trials", "base.steps"}
    big = StudySpec.model_validate({**BASE, "search_space": {
        "model.d_model": {"type": "categorical", "choices": [64, 4096]}}})  # fmt: skip
    assert [
        e.field for e in check_limits(big, max_trials=10, max_steps=10**6, max_params=10**6)
    ] == ["base.model"]


def test_parse_spec_yaml_and_json_agree_and_reject_aliases() -> None:
    y = b"name: t\nbudget: {n_trials: 3}\n"
    j = b'{"name": "t", "budget": {"n_trials": 3}}'
    assert parse_spec(y, "application/yaml") == parse_spec(j, "application/json")
    bomb = b"a: &a [x, x]\nb: &b [*a, *a]\nname: t\nbudget: {n_trials: 1}\n"
    with pytest.raises(SpecError):
        parse_spec(bomb, "application/yaml")
    with pytest.raises(SpecError):
        parse_spec(b"[1, 2]", "application/json")


def test_fuse_auto_resolves_per_study_and_never_refuses() -> None:
    """`fuse: auto`: slots from the base config (workers.fusion_plan.auto_fuse); a base the
    fused model refuses gets 1 slot (no fusion) where an explicit fuse > 1 is a 422."""
    rnd = {**BASE, "sampler": {"kind": "random", "seed": 0}}
    small = StudySpec.model_validate({**rnd, "base": {"batch_size": 4}})
    assert small.fuse == "auto" and small.slots == 4  # the default; 0.18 GFLOP a step
    medium = StudySpec.model_validate({**rnd, "base": {"batch_size": 8}})
    assert medium.slots == 1  # 0.35 GFLOP: fusion costs more than it saves on a CPU core
    # under every sampler: TPE (the default) and GP fuse as random does (bench/archive/fuse_sampler.py)
    for kind in ("tpe", "gp", "cmaes"):
        learner = {**BASE, "sampler": {"kind": kind}}
        assert StudySpec.model_validate({**learner, "base": {"batch_size": 4}}).slots == 4
        assert StudySpec.model_validate({**learner, "base": {"batch_size": 8}}).slots == 1
    big_model = {"n_layers": 4, "n_heads": 4, "d_model": 128, "d_ff": 512}
    big = {**rnd, "fuse": "auto", "base": {"model": big_model, "batch_size": 64}}
    assert StudySpec.model_validate(big).slots == 1
    on_gpu = {**big, "resources": {"cpus": 1, "gpus": 0.25}}
    assert StudySpec.model_validate(on_gpu).slots == 8
    dropout = {**rnd, "base": {"model": {"dropout": 0.1}}}
    assert StudySpec.model_validate({**dropout, "fuse": "auto"}).slots == 1
    assert any("fuse" in m for m in errors_of({**dropout, "fuse": 4}))
    assert StudySpec.model_validate({**BASE, "fuse": 3}).slots == 3


def test_data_dir_without_a_data_root_must_still_be_relative_and_stay_down() -> None:
    """With QKSCOPE_DATA_DIR unset the workers read relative paths from their working
    directory: absolute, `~` and `..` paths are refused all the same."""
    from service.spec import check_data_dirs

    def spec(data_dir: str) -> StudySpec:
        task = {"kind": "lm", "data_dir": data_dir, "tokenizer": "char", "vocab_cap": 256}
        return StudySpec.model_validate(
            {"name": "d", "budget": {"n_trials": 1}, "base": {"task": task}}
        )

    for bad in ("/data/wikitext-2", "~/corpus", "../corpus", "a/../../b", ""):
        assert [e.field for e in check_data_dirs(spec(bad), "")] == ["base.task.data_dir"], bad
    assert check_data_dirs(spec("wikitext-2"), "") == []


def test_zero_step_float64_bidirectional_probes_are_valid_specs() -> None:
    """What docs/metrics.md section 8 needs: a study of untrained float64 models without the
    causal mask, searched over the mask; steps 0 without eval_at_init names the field."""
    spec = StudySpec.model_validate(
        {
            "name": "probe",
            "budget": {"n_trials": 2},
            "base": {"steps": 0, "eval_at_init": True, "dtype": "float64"},
            "search_space": {"model.causal": {"type": "categorical", "choices": [True, False]}},
            "sampler": {"kind": "grid"},
        }
    )
    assert spec.base.steps == 0 and spec.base.dtype == "float64"
    assert apply_params(spec.base, {"model.causal": False}).model.causal is False
    with pytest.raises(ValidationError) as e:
        StudySpec.model_validate({"name": "bad", "budget": {"n_trials": 1}, "base": {"steps": 0}})
    assert e.value.errors()[0]["loc"][0] == "base"
    assert "eval_at_init" in str(e.value)
