"""The width rule of a model config (`d_ff_ratio`, `head_dim`): a study over d_model keeps
the MLP ratio and the head width, in the trial config, in the POST-time checks and in the
memory estimate's worst point."""

from __future__ import annotations

import json

import pytest

from service.spec import parse_spec
from service.spec.space import worst_points
from workers.config import ModelConfig, TrialConfig


def test_the_rule_sets_d_ff_and_n_heads_from_the_width() -> None:
    for w in (32, 64, 256):
        m = ModelConfig(d_model=w, d_ff=172, n_heads=2, d_ff_ratio=8 / 3, head_dim=16)
        assert m.d_ff == round(8 / 3 * w) and m.n_heads == w // 16
    assert ModelConfig(d_model=64, d_ff=100).d_ff == 100  # no rule: as given
    with pytest.raises(ValueError, match="multiple of head_dim"):
        ModelConfig(d_model=48, head_dim=32)
    # a dumped config validated again (a trial's config after with_params) keeps the rule
    dumped = TrialConfig(model={"d_model": 32, "d_ff_ratio": 4.0}).model_dump()
    dumped["model"]["d_model"] = 128
    assert TrialConfig.model_validate(dumped).model.d_ff == 512


def _spec(model: dict[str, object], widths: list[int]) -> bytes:
    return json.dumps({
        "name": "rule",
        "base": {"model": {"n_layers": 1, **model}},
        "search_space": {"model.d_model": {"type": "categorical", "choices": widths}},
        "sampler": {"kind": "grid", "seed": 0},
        "budget": {"n_trials": len(widths)},
    }).encode()  # fmt: skip


def test_post_checks_and_the_memory_worst_point_follow_the_rule() -> None:
    spec = parse_spec(_spec({"d_model": 32, "d_ff_ratio": 4.0, "head_dim": 16}, [32, 256]), "json")
    (worst, *_) = [c for _, c in worst_points(spec)]
    assert worst.model.d_model == 256 and worst.model.d_ff == 1024 and worst.model.n_heads == 16
    with pytest.raises(ValueError) as e:  # 40 is not a multiple of the head width
        parse_spec(_spec({"d_model": 32, "head_dim": 16}, [32, 40]), "json")
    assert "search_space.model.d_model" in str(e.value) and "head_dim" in str(e.value)
