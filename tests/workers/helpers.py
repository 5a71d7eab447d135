"""Helpers shared by the worker tests: tiny trial configs, a recording reporter, and the
fused-equals-alone comparison."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from workers.config import MetricPoint, TrialConfig

REPO = Path(__file__).resolve().parents[2]
REL_TOL = 1e-4  # fused vs alone in float32 (bench/README.md, "fused: equality")


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


TINY: dict[str, Any] = {
    "task": {
        "kind": "associative_recall",
        "seq_len": 16,
        "n_pairs": 4,
        "n_symbols": 8,
        "n_valid": 32,
    },
    "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
    "batch_size": 8,
    "steps": 20,
    "eval_every": 5,
    "eval_batches": 2,
    "probe_batch_size": 4,
    "device": "cpu",
    "seed": 0,
}


def tiny(**over: Any) -> TrialConfig:
    return TrialConfig.model_validate(merge(TINY, over))


class Recorder:
    """A reporter that keeps every report; optionally stops or crashes at a given report."""

    def __init__(self, stop_at_report: int | None = None, crash_at_step: int | None = None) -> None:
        self.reports: list[tuple[int, list[MetricPoint]]] = []
        self.values: dict[int, float | None] = {}  # the intermediate value of each report
        self.stop_at_report = stop_at_report
        self.crash_at_step = crash_at_step

    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None:
        if self.crash_at_step is not None and step == self.crash_at_step:
            raise RuntimeError(f"simulated crash at step {step}")
        self.reports.append((step, list(metrics)))
        self.values[step] = value
        if self.stop_at_report is not None and len(self.reports) == self.stop_at_report:
            return f"the test stops it at report {len(self.reports)}"
        return None

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.reports]

    def stream(self, after: int = 0) -> list[tuple[int, str, int | None, int | None, float]]:
        """Every reported number as (step, name, layer, head, value), in report order."""
        return [
            (s, p.name, p.layer, p.head, p.value)
            for s, points in self.reports
            if s > after
            for p in points
        ]

    def at(self, step: int) -> dict[tuple[str, int | None, int | None], float]:
        for s, points in self.reports:
            if s == step:
                return {(p.name, p.layer, p.head): p.value for p in points}
        raise KeyError(step)


def quickstart(**over: Any) -> TrialConfig:
    base = yaml.safe_load((REPO / "study_defs" / "quickstart.yaml").read_text())["base"]
    data: dict[str, Any] = {**base, "device": "cpu", "dtype": "float32", "steps": 100}
    data["eval_every"] = 25
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return TrialConfig.model_validate(data)


# Four members that differ in everything a member may: lr, wd, betas, seed, regularizer kind,
# lambda and target, QK init scale and attention temperature (the stable region: see
# bench/README.md, "fused: equality", for what large qk_init_std does to run-alone twins).
MEMBERS: list[dict[str, Any]] = [
    {"seed": 0, "optim": {"lr": 3e-3}, "regularizer": {"kind": "locater", "lambda": 0.01}},
    {
        "seed": 1,
        "optim": {"lr": 1e-3, "weight_decay": 0.1},
        "regularizer": {"kind": "spectral_variance", "lambda": 0.1},
        "model": {"qk_init_std": 0.1},
    },
    {
        "seed": 2,
        "optim": {"lr": 5e-3, "weight_decay": 0.01},
        "regularizer": {"kind": "none"},
        "model": {"attn_temperature": 2.0},
    },
    {
        "seed": 3,
        "optim": {"lr": 2e-3, "weight_decay": 0.05, "beta2": 0.99, "grad_clip": 0.5},
        "regularizer": {"kind": "locater", "lambda": 0.3, "target_mean": 0.5},
        "model": {"qk_init_std": 0.05},
    },
]


def rel(a: float | None, b: float | None) -> float:
    assert a is not None and b is not None and math.isfinite(a) and math.isfinite(b)
    return abs(a - b) / max(abs(a), 1e-12)


def assert_same_evaluations(alone: Recorder, fused: Recorder) -> None:
    assert fused.steps == alone.steps
    for step in alone.steps:
        a, f = alone.at(step), fused.at(step)
        assert set(a) == set(f)
        for name in ("val_loss", "train_loss"):
            assert rel(a[(name, None, None)], f[(name, None, None)]) < REL_TOL, (step, name)


# Tiny configs of every allow-listed Hugging Face family (workers/hf_families.py): grouped-query
# heads where the family has them (llama 4:2, mistral 4:1), Qwen3's per-head and OLMo 2's
# all-heads QK norm, GPT-2's fused c_attn.
HF_TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
    "qwen3": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
    },
    "olmo2": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
    "mistral": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 64,
    },
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
}


def hf_model_section(model_type: str, **config: Any) -> dict[str, Any]:
    """A `model` section for a tiny model of the family (config keys override)."""
    return {"kind": "hf", "hf": {"model_type": model_type, "config": HF_TINY[model_type] | config}}


def hf_tiny(model_type: str, **over: Any) -> TrialConfig:
    """`tiny` with a tiny Hugging Face model of the family in place of the built-in one."""
    data = merge(TINY, over)
    data["model"] = hf_model_section(model_type)
    return TrialConfig.model_validate(data)
