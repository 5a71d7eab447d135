"""The bad-input table of `model.kind: hf` (docs/bring-your-model.md): each bad model section
or search over it POSTed gets a 4xx naming the field, and writes no row; the good forms are
accepted, `model.hf.config.<key>` searchable like any knob. No Ray (studies stay PENDING)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.store.session import make_engine
from tests.service.helpers import check_rejected, n_studies, post

JSON = "application/json"
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def study(model: dict[str, Any], space: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "hf",
        "budget": {"n_trials": 4},
        "base": {"task": {"kind": "sort", "seq_len": 16}, "steps": 10, "model": model},
        "search_space": space or {"optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2}},
        **top,
    }
    return body


def hf(model_type: str = "llama", **config: Any) -> dict[str, Any]:
    base = LLAMA if model_type != "gpt2" else {"n_embd": 32, "n_layer": 2, "n_head": 4}
    return {"kind": "hf", "hf": {"model_type": model_type, "config": {**base, **config}}}


def cat(*choices: Any) -> dict[str, Any]:
    return {"type": "categorical", "choices": list(choices)}


CFG = "base.model.hf.config"
# (label, body, the field named)
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown model_type", study({"kind": "hf", "hf": {"model_type": "bert"}}), "base.model.hf.model_type"),
    ("trust_remote_code", study(hf(trust_remote_code=True)), f"{CFG}.trust_remote_code"),
    ("auto_map", study(hf(auto_map="x.Model")), f"{CFG}.auto_map"),
    ("a key the family does not know", study(hf(rope_scaling=2)), f"{CFG}.rope_scaling"),
    ("a gpt2 key on llama", study(hf(n_embd=32)), f"{CFG}.n_embd"),
    ("vocab_size from the request", study(hf(vocab_size=99)), f"{CFG}.vocab_size"),
    ("heads do not divide the width", study(hf(hidden_size=30)), f"{CFG}.num_attention_heads"),
    ("kv heads do not divide the heads", study(hf(num_key_value_heads=3)), f"{CFG}.num_key_value_heads"),
    ("odd rotary head width", study(hf("olmo2", hidden_size=36)), f"{CFG}.num_attention_heads"),
    ("odd explicit head_dim", study(hf("qwen3", head_dim=7)), f"{CFG}.head_dim"),
    ("gpt2 heads do not divide", study(hf("gpt2", n_head=5)), f"{CFG}.n_head"),
    ("a size that is not an integer", study(hf(hidden_size="big")), f"{CFG}.hidden_size"),
    ("a zero size", study(hf(num_hidden_layers=0)), f"{CFG}.num_hidden_layers"),
    ("positions shorter than seq_len", study(hf(max_position_embeddings=8)), f"{CFG}.max_position_embeddings"),
    ("kind hf without its section", study({"kind": "hf"}), "base.model.hf"),
    ("hf section on the built-in model", study({"hf": hf()["hf"]}), "base.model.hf"),
    ("a built-in field with kind hf", study({**hf(), "n_heads": 4}), "base.model.n_heads"),
    ("an unknown plug-in", study({"kind": "plugin", "plugin": {"name": "nope"}}), "base.model.plugin.name"),
    ("kind plugin without its section", study({"kind": "plugin"}), "base.model.plugin"),
    ("fuse > 1 with an hf model", study(hf(), fuse=2), "fuse"),
    # searched
    ("searched kv heads that do not divide", study(hf(), {"model.hf.config.num_key_value_heads": cat(1, 3)}), "search_space.model.hf.config.num_key_value_heads"),
    ("searched heads and kv heads that do not divide together", study(hf(hidden_size=48), {
        "model.hf.config.num_attention_heads": cat(4, 6),
        "model.hf.config.num_key_value_heads": cat(2, 4),
    }), "search_space.model.hf.config.num_key_value_heads"),
    ("searched unknown key", study(hf(), {"model.hf.config.bogus": cat(1, 2)}), "search_space.model.hf.config.bogus"),
    ("searched built-in field with kind hf", study(hf(), {"model.norm": cat("pre", "post")}), "search_space.model.norm"),
]  # fmt: skip

GOOD: list[tuple[str, dict[str, Any]]] = [
    ("llama, kv heads and rope_theta searched", study(hf(), {
        "model.hf.config.num_key_value_heads": cat(1, 2, 4),
        "model.hf.config.rope_theta": {"type": "float", "low": 1e3, "high": 1e6, "log": True},
    })),
    ("every family", study(hf(), {"model.hf.model_type": cat("llama", "qwen3", "olmo2", "mistral")})),
    ("gpt2", study(hf("gpt2", scale_attn_by_inverse_layer_idx=True))),
]  # fmt: skip


def test_bad_hf_models_are_422s_naming_the_field_and_nothing_is_written(
    db_url: str, tmp_path: Path
) -> None:
    settings = Settings(database_url=db_url, ray_address="", api_tokens="", home=tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        engine = make_engine(db_url)
        try:
            for label, body, field in CASES:
                out = check_rejected(c, body, JSON, label)
                assert out["status"] == 422, (label, out)
                assert [e["field"] for e in out["errors"]] == [field], (label, out)
            # past the deployment's parameter limit: sizes of the family's own keys count
            big = study(hf(hidden_size=8192, intermediate_size=32768, num_hidden_layers=64))
            out = check_rejected(c, big, JSON)
            assert out["error"] == "limit_exceeded" and out["status"] == 422, out
            assert "base.model" in [e["field"] for e in out["errors"]], out
            assert n_studies(engine) == 0
            for i, (label, body) in enumerate(GOOD):
                r = post(c, {**body, "name": f"good-{i}"}, JSON)
                assert r.status_code == 201, (label, r.text)
            assert n_studies(engine) == len(GOOD)
        finally:
            engine.dispose()
