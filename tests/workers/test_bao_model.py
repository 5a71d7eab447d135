"""Bao et al.'s model (issue 35): fairseq's sqrt(D)-scaled token embedding, and the effective
QK form diag(g) W diag(g) under Pre-LN (docs/metrics.md section 3), each checked against an
independent computation: the explicit (D, D) matrix and torch.linalg's eigenvalues."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from workers.config import ModelConfig
from workers.metrics import qk_effective_eigen_stats
from workers.model import GPT
from workers.trial import probe_metrics


def _explicit_reference(
    w_q: torch.Tensor, w_k: torch.Tensor, g: torch.Tensor
) -> tuple[float, float]:
    """(mean, var) of the eigenvalues of G W G, G = diag(g), from the explicit matrix: the mean
    from all its (complex) eigenvalues, the variance from eigvalsh of its symmetric part."""
    d_h = w_q.shape[0]
    w = w_q.T @ w_k / math.sqrt(d_h)
    eff = torch.diag(g) @ w @ torch.diag(g)
    mean = torch.linalg.eigvals(eff).real.mean().item()
    lam = torch.linalg.eigvalsh((eff + eff.T) / 2)
    var = (lam.square().mean() - lam.mean().square()).item()
    return mean, var


@pytest.mark.parametrize(("d_h", "d"), [(4, 4), (3, 8), (8, 16)])
def test_effective_eigen_stats_match_the_explicit_form(d_h: int, d: int) -> None:
    gen = torch.Generator().manual_seed(d_h * 100 + d)
    w_q = torch.randn(2, d_h, d, generator=gen, dtype=torch.float64)  # (H, d_h, D)
    w_k = torch.randn(2, d_h, d, generator=gen, dtype=torch.float64)
    g = 0.5 + torch.rand(d, generator=gen, dtype=torch.float64) * 2  # gains far from 1
    mean, var = qk_effective_eigen_stats(w_q, w_k, g)
    for h in range(2):
        ref_mean, ref_var = _explicit_reference(w_q[h], w_k[h], g)
        assert mean[h].item() == pytest.approx(ref_mean, rel=1e-10, abs=1e-12)
        assert var[h].item() == pytest.approx(ref_var, rel=1e-10, abs=1e-12)
    # with unit gains it is W's own spectrum: g = 2 scales every eigenvalue by 4
    mean2, var2 = qk_effective_eigen_stats(w_q, w_k, torch.full((d,), 2.0, dtype=torch.float64))
    ref = _explicit_reference(w_q[0], w_k[0], torch.ones(d, dtype=torch.float64))
    assert mean2[0].item() == pytest.approx(4 * ref[0], rel=1e-10, abs=1e-12)
    assert var2[0].item() == pytest.approx(16 * ref[1], rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_probe_stores_the_effective_form_under_pre_ln(norm_type: str) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layers=2, n_heads=2, d_model=8, d_ff=8, qk_init_std=0.3, norm_type=norm_type
    )
    model = GPT(cfg, vocab_size=10, seq_len=6).double()
    with torch.no_grad():  # trained-looking gains, different per layer
        for block in model.blocks:
            block.ln1.weight.copy_(0.3 + 2 * torch.rand(8, dtype=torch.float64))
    points = probe_metrics(model, torch.randint(0, 10, (2, 6)))
    got = {(p.name, p.layer, p.head): p.value for p in points}
    d_h = 4
    for layer in range(1, 3):
        block = model.blocks[layer - 1]
        q, k = block.attn.q_proj.weight.detach(), block.attn.k_proj.weight.detach()
        g = block.ln1.weight.detach()
        for h in range(2):
            rows = slice(h * d_h, (h + 1) * d_h)
            ref_mean, ref_var = _explicit_reference(q[rows], k[rows], g)
            assert got[("qk_eff_eig_mean", layer, h)] == pytest.approx(ref_mean, rel=1e-9)
            assert got[("qk_eff_eig_var", layer, h)] == pytest.approx(ref_var, rel=1e-9)
            # W's own stats stay beside it, and differ (the gains are not 1)
            assert got[("qk_eig_var", layer, h)] != pytest.approx(ref_var, rel=1e-3)


@pytest.mark.parametrize("model", [{"norm": "post"}, {"norm": "none"}])
def test_no_effective_form_without_a_norm_before_attention(model: dict[str, str]) -> None:
    torch.manual_seed(0)
    gpt = GPT(ModelConfig(n_layers=2, n_heads=1, d_model=8, d_ff=8, **model), 10, 6)
    names = {p.name for p in probe_metrics(gpt, torch.randint(0, 10, (2, 6)))}
    assert "qk_eig_var" in names
    assert not names & {"qk_eff_eig_mean", "qk_eff_eig_var"}


def test_embed_scale_sqrt_d_is_fairseqs_embedding() -> None:
    d, v, t = 128, 50, 6
    torch.manual_seed(1)
    plain = GPT(ModelConfig(n_layers=1, n_heads=1, d_model=d, d_ff=d, norm="post"), v, t)
    torch.manual_seed(1)
    cfg = ModelConfig(n_layers=1, n_heads=1, d_model=d, d_ff=d, norm="post", embed_scale="sqrt_d")
    scaled = GPT(cfg, v, t)
    w0, w1 = plain.tok_emb.weight.detach(), scaled.tok_emb.weight.detach()
    # the same draw rescaled to std 1/sqrt(D): nothing else drawn, every other weight equal
    torch.testing.assert_close(w1, w0 * (d**-0.5 / 0.02), rtol=1e-6, atol=0)
    assert w1.std().item() == pytest.approx(d**-0.5, rel=0.05)
    for (name, p0), (_, p1) in zip(
        plain.named_parameters(), scaled.named_parameters(), strict=True
    ):
        if name != "tok_emb.weight":
            assert torch.equal(p0, p1), name
    idx = torch.randint(0, v, (2, t))
    pos = scaled.pos_emb.weight.detach()[:t]
    # tokens times sqrt(D), entries of unit scale, positions added after the scaling
    torch.testing.assert_close(scaled._embed(idx), w1[idx] * math.sqrt(d) + pos)
    assert (w1[idx] * math.sqrt(d)).square().sum(-1).mean().item() == pytest.approx(d, rel=0.1)
    # the tied head reads the unscaled weight
    assert scaled.head.weight is scaled.tok_emb.weight


def test_embed_scale_with_token_scale_init_is_refused_by_name() -> None:
    with pytest.raises(ValidationError) as err:
        ModelConfig(embed_scale="sqrt_d", init_scheme="token_scale")
    assert "embed_scale" in str(err.value)


def test_qkv_init_fairseq_is_xavier_uniform_at_gain_one_over_sqrt_2() -> None:
    """fairseq's MultiheadAttention.reset_parameters: q, k, v xavier_uniform with gain
    1/sqrt(2), the output projection with gain 1: uniform on [-a, a] with a = gain *
    sqrt(6 / (fan_in + fan_out)), std a / sqrt(3) (0.0625 for q, k, v at D = 128). Every other
    weight is the normal draw, bit for bit, and the config hash of the default is unchanged."""
    from workers.config import TrialConfig
    from workers.provenance import config_hash

    d, v, t = 128, 50, 6
    torch.manual_seed(3)
    plain = GPT(ModelConfig(n_layers=2, n_heads=2, d_model=d, d_ff=d, norm="post"), v, t)
    torch.manual_seed(3)
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=d, d_ff=d, norm="post", qkv_init="fairseq")
    fair = GPT(cfg, v, t)
    bound = {"q_proj": 2**-0.5 * math.sqrt(6 / (2 * d)), "out_proj": math.sqrt(6 / (2 * d))}
    bound["k_proj"] = bound["v_proj"] = bound["q_proj"]
    for (name, p0), (_, p1) in zip(plain.named_parameters(), fair.named_parameters(), strict=True):
        proj = name.split(".")[-2] if name.endswith("proj.weight") else None
        if proj in bound:
            w = p1.detach().double()
            assert w.abs().max().item() <= bound[proj]
            assert w.std().item() == pytest.approx(bound[proj] / math.sqrt(3), rel=0.03), name
            # uniform, not normal: the fourth standardized moment is 1.8 (normal: 3)
            z = (w - w.mean()) / w.std()
            assert z.pow(4).mean().item() == pytest.approx(1.8, abs=0.1), name
        else:
            assert torch.equal(p0, p1), name
    assert bound["q_proj"] / math.sqrt(3) == pytest.approx(0.0625)
    with pytest.raises(ValidationError) as err:
        ModelConfig(qkv_init="fairseq", qk_init_std=0.1)
    assert "qkv_init" in str(err.value)
    base = TrialConfig()
    explicit = TrialConfig.model_validate({"model": {"qkv_init": "normal"}})
    other = TrialConfig.model_validate({"model": {"qkv_init": "fairseq"}})
    assert config_hash(base) == config_hash(explicit) != config_hash(other)
