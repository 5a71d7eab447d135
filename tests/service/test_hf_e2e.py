"""Every allow-listed Hugging Face family end to end on a real local Ray head, through REST,
on SQLite: a grid over `model.hf.model_type` (the four Llama-keyed families) and a GPT-2 study,
run at once; each trial COMPLETES with its per-layer and per-head metric rows stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.control.ray_cluster import LocalRayHead
from tests.service.helpers import settings_for, wait_for

pytestmark = pytest.mark.cluster

LOOP: dict[str, Any] = {
    "task": {"kind": "sort", "seq_len": 16, "n_symbols": 8, "n_valid": 32},
    "batch_size": 8,
    "steps": 4,
    "eval_every": 2,
    "eval_batches": 1,
    "probe_batch_size": 2,
}
DECODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_every_family_completes_with_per_head_rows(ray_head: LocalRayHead, tmp_path: Path) -> None:
    decoders = {
        "name": "hf-decoders",
        "base": {**LOOP, "model": {"kind": "hf", "hf": {"model_type": "llama", "config": DECODER}}},
        "search_space": {
            "model.hf.model_type": {
                "type": "categorical",
                "choices": ["llama", "qwen3", "olmo2", "mistral"],
            }
        },
        "sampler": {"kind": "grid"},
        "budget": {"n_trials": 4},
        "max_retries": 0,
    }
    gpt2 = {
        "name": "hf-gpt2",
        "base": {
            **LOOP,
            "model": {
                "kind": "hf",
                "hf": {"model_type": "gpt2", "config": {"n_embd": 32, "n_layer": 2, "n_head": 4}},
            },
        },
        "search_space": {"optim.lr": {"type": "categorical", "choices": [0.003]}},
        "sampler": {"kind": "grid"},
        "budget": {"n_trials": 1},
        "max_retries": 0,
    }
    settings = settings_for(f"sqlite:///{tmp_path / 'qkscope.db'}", ray_head, tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False)) as c:
        ids = []
        for body in (decoders, gpt2):
            r = c.post("/v1/studies", json=body)
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        done = [wait_for(c, sid, {"COMPLETED", "FAILED", "CANCELLED"}, 600) for sid in ids]
        assert [d["status"] for d in done] == ["COMPLETED", "COMPLETED"], done
        trials = [t for sid in ids for t in c.get(f"/v1/studies/{sid}/trials").json()["items"]]
        families = {t["params"].get("model.hf.model_type", "gpt2") for t in trials}
        assert families == {"llama", "qwen3", "olmo2", "mistral", "gpt2"}, trials
        for t in trials:
            assert t["state"] == "COMPLETE", t
            assert t["final_val_loss"] is not None and t["qk_eig_var"] is not None, t
            for name, index in (("attn_entropy_norm", "head"), ("rank_ratio", "layer")):
                rows = c.get(f"/v1/trials/{t['id']}/metrics", params={"name": name}).json()
                last = [m for m in rows if m["step"] == 4]
                if index == "head":  # 2 layers x 4 query heads
                    assert {(m["layer"], m["head"]) for m in last} == {
                        (la, h) for la in (1, 2) for h in range(4)
                    }, (t["params"], rows)
                else:  # layers 0 (embeddings) .. 2
                    assert {m["layer"] for m in last} == {0, 1, 2}, (t["params"], rows)
