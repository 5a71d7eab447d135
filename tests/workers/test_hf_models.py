"""`model.kind: hf` (workers/models/hf.py): every allow-listed family's probes against
independent computations (transformers' eager attention with `output_attentions`, numpy), its
regularizers, and a trial that trains, reports and resumes from its checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.workers.helpers import HF_TINY, Recorder, hf_tiny
from workers.config_sections import HFModelSpec
from workers.evaluation import penalty, probe_metrics
from workers.hf_families import HF_FAMILIES
from workers.models.hf import TRAIN_ATTENTION, HFModel
from workers.trial import run_trial

FAMILIES = sorted(HF_FAMILIES)
VOCAB, T = 40, 12


def test_every_settable_key_is_known_to_transformers() -> None:
    from transformers import AutoConfig

    for model_type, family in HF_FAMILIES.items():
        known = set(AutoConfig.for_model(model_type).to_dict())
        assert family.keys - {"rope_theta"} <= known, model_type
        if family.rotary:  # rope_theta is taken as a keyword and lands in rope_parameters
            cfg = AutoConfig.for_model(model_type, rope_theta=12345.0)
            assert cfg.rope_parameters["rope_theta"] == 12345.0


def _model(model_type: str, **config: Any) -> HFModel:
    torch.manual_seed(0)
    spec = HFModelSpec(model_type=model_type, config=HF_TINY[model_type] | config)
    model = HFModel(spec, vocab_size=VOCAB, seq_len=T).double()
    with torch.no_grad():  # QK-norm gains away from 1, so a wrong gain layout shows
        for layer in model.layers:
            for name in ("q_norm", "k_norm"):
                norm = getattr(layer.attn, name, None)
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def _explicit_forms(model: HFModel) -> list[list[np.ndarray]]:
    """Per layer and query head, W_h of METRICS.md 10 built from the raw module weights."""
    h, h_kv, d_h = model.n_heads, model.n_kv_heads, model.d_head
    forms = []
    for layer in model.layers:
        att = layer.attn
        if model.model_type == "gpt2":
            w = att.c_attn.weight.detach().numpy()  # (D, 3 D): y = x @ w
            d = w.shape[0]
            w_q, w_k = w[:, :d].T, w[:, d : 2 * d].T  # (D_out, D_in)
        else:
            w_q = att.q_proj.weight.detach().numpy()
            w_k = att.k_proj.weight.detach().numpy()
        g_q_all = att.q_norm.weight.detach().numpy() if hasattr(att, "q_norm") else None
        g_k_all = att.k_norm.weight.detach().numpy() if hasattr(att, "k_norm") else None
        per_head = []
        for q_head in range(h):
            k_head = q_head // (h // h_kv)
            rows_q = w_q[q_head * d_h : (q_head + 1) * d_h]
            rows_k = w_k[k_head * d_h : (k_head + 1) * d_h]
            g = np.ones(d_h)
            if g_q_all is not None and g_k_all is not None:
                if g_q_all.shape[0] == d_h:  # one norm shared by every head (Qwen3)
                    g = g_q_all * g_k_all
                else:  # one norm over all heads (OLMo 2): its slice of each head
                    g = g_q_all[q_head * d_h : (q_head + 1) * d_h]
                    g = g * g_k_all[k_head * d_h : (k_head + 1) * d_h]
            per_head.append(rows_q.T @ np.diag(g) @ rows_k * float(att.scaling))
        forms.append(per_head)
    return forms


def _eig_mean_var(w: np.ndarray) -> tuple[float, float]:
    ev = np.linalg.eigvalsh((w + w.T) / 2)
    return float(np.trace(w) / w.shape[0]), float(ev.var())


@pytest.mark.parametrize("model_type", FAMILIES)
def test_probe_matches_eager_attention_and_numpy(model_type: str) -> None:
    # GPT-2 with its per-layer scale, so the probe's scale is the layer's, not the first's
    extra = {"scale_attn_by_inverse_layer_idx": True} if model_type == "gpt2" else {}
    model = _model(model_type, **extra)
    x = torch.randint(0, VOCAB, (3, T), generator=torch.Generator().manual_seed(1))
    out = model.probe(x)
    assert model.net.config._attn_implementation == TRAIN_ATTENTION  # training stays fast

    model.net.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model.net(input_ids=x, output_attentions=True, output_hidden_states=True)
        model.net.set_attn_implementation(TRAIN_ATTENTION)
        fast_logits, _ = model(x)

    assert len(out.attn) == len(model.layers) == 2
    torch.testing.assert_close(out.logits, fast_logits, rtol=0, atol=1e-10)
    for mine, theirs in zip(out.hidden, ref.hidden_states, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    causal = np.tril(np.ones((T, T), dtype=bool))
    points = probe_metrics(model, x)
    by = {(p.name, p.layer, p.head): p.value for p in points}
    for layer, (attn, eager) in enumerate(zip(out.attn, ref.attentions, strict=True)):
        assert attn.shape == (3, 4, T, T)
        # transformers' eager softmax runs in float32: agreement to float32's precision
        torch.testing.assert_close(attn, eager, rtol=0, atol=1e-6)
        # q, k and the scale as recorded reproduce the model's own attention (numpy)
        q, k = (t.numpy() for t in out.qk[layer])
        z = out.layer_scale(layer) * q @ k.transpose(0, 1, 3, 2)  # (B, H, T, T)
        z = np.where(causal, z, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(p, eager.numpy(), atol=1e-6)
        logit_max = np.abs(np.where(causal, z, 0.0)).max(axis=(0, 2, 3))
        e = eager.numpy()
        ent = -(e * np.log(np.where(e > 0, e, 1.0))).sum(-1).mean(axis=(0, 2))
        for h in range(4):
            assert by[("attn_logit_max", layer + 1, h)] == pytest.approx(logit_max[h], rel=1e-9)
            assert by[("attn_entropy", layer + 1, h)] == pytest.approx(ent[h], abs=1e-6)
    if model_type == "gpt2":
        assert out.scales is not None and out.scales[0] == 2 * out.scales[1]
    # the eigenspectrum of W_h = w_q^T diag(g_q g_k) w_k * scaling, per query head
    for layer, heads in enumerate(_explicit_forms(model), start=1):
        for h, w in enumerate(heads):
            mean, var = _eig_mean_var(w)
            assert by[("qk_eig_mean", layer, h)] == pytest.approx(mean, rel=1e-9, abs=1e-15)
            assert by[("qk_eig_var", layer, h)] == pytest.approx(var, rel=1e-9, abs=1e-15)
    has_pre_norm = model_type != "olmo2"  # OLMo 2 norms after the attention: no input gain
    assert (("qk_eff_eig_var", 1, 0) in by) == has_pre_norm


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "gpt2"])
def test_penalties_act_on_the_family_rows_in_float32(model_type: str) -> None:
    from workers.config import RegularizerConfig

    model = _model(model_type).float().train()
    reg = RegularizerConfig.model_validate({"kind": "spectral_variance", "lambda": 1.0})
    value = penalty(model, reg)
    assert value.dtype == torch.float32
    expected = np.mean(
        [_eig_mean_var(w.astype(np.float64))[1] for heads in _explicit_forms(model) for w in heads]
    )
    assert float(value.detach()) == pytest.approx(expected, rel=1e-4)
    value.backward()  # type: ignore[no-untyped-call]
    att = model.layers[0].attn
    proj = att.c_attn.weight if model_type == "gpt2" else att.q_proj.weight
    assert proj.grad is not None and float(proj.grad.abs().sum()) > 0
    if model_type != "gpt2":  # the QK-norm gains are part of the form: they get a gradient
        assert att.q_norm.weight.grad is not None and float(att.q_norm.weight.grad.abs().sum()) > 0


def test_hf_trial_trains_reports_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    over: dict[str, Any] = {
        "steps": 6,
        "eval_every": 2,
        "regularizer": {"kind": "locater", "lambda": 0.1},
        "z_loss_coef": 1e-4,
    }
    rec_a = Recorder()
    s_a = run_trial(hf_tiny("llama", **over, checkpoint={"dir": str(tmp_path / "a")}), rec_a)
    assert s_a.status == "completed" and rec_a.steps == [2, 4, 6]
    at = rec_a.at(6)
    assert {h for (n, _, h) in at if n == "attn_entropy_norm"} == {0, 1, 2, 3}
    assert {la for (n, la, _) in at if n == "rank_ratio"} == {0, 1, 2}
    assert ("reg_penalty", None, None) in at
    assert s_a.final_val_loss is not None and s_a.max_attn_logit_ever is not None

    cfg_b = hf_tiny("llama", **over, checkpoint={"dir": str(tmp_path / "b")})
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_trial(cfg_b, Recorder(crash_at_step=4))
    rec_b = Recorder()
    s_b = run_trial(cfg_b, rec_b)
    assert rec_b.steps == [4, 6]
    assert rec_b.stream() == rec_a.stream(after=2)
    assert s_b.final_val_loss == s_a.final_val_loss


@pytest.mark.parametrize("model_type", ["qwen3", "olmo2", "mistral", "gpt2"])
def test_every_family_trains_a_trial(model_type: str) -> None:
    summary = run_trial(hf_tiny(model_type, steps=2, eval_every=2))
    assert summary.status == "completed" and summary.final_val_loss is not None
    assert summary.qk_eig_var is not None and summary.min_norm_entropy is not None
