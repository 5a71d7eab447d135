"""Tests for workers.model: shapes, the explicit probe path, init knobs and the variants."""

from __future__ import annotations

import itertools
from typing import Any

import pydantic
import pytest
import torch
from torch import Tensor, nn

from workers.model import GPT, Block, ModelConfig, SigmaReparamLinear

VOCAB, SEQ = 24, 12


def _model(seed: int = 0, vocab: int = VOCAB, seq: int = SEQ, **kw: object) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig.model_validate({"n_layers": 2, "n_heads": 4, "d_model": 32, "d_ff": 64, **kw})
    return GPT(cfg, vocab_size=vocab, seq_len=seq)


def _idx(b: int = 3, t: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_forward_and_probe_shapes() -> None:
    m = _model(n_layers=3, n_heads=4, d_model=32).eval()
    idx = _idx(b=5, t=SEQ)
    logits, loss = m(idx)
    assert logits.shape == (5, SEQ, VOCAB)
    assert loss is None
    out = m.probe(idx)
    assert out.logits.shape == (5, SEQ, VOCAB)
    assert len(out.attn) == 3
    assert all(a.shape == (5, 4, SEQ, SEQ) for a in out.attn)
    assert len(out.hidden) == 4
    assert all(h.shape == (5, SEQ, 32) for h in out.hidden)


def test_forward_shorter_sequence_and_loss() -> None:
    m = _model().eval()
    idx = _idx(b=2, t=5)
    targets = idx.clone()
    targets[:, :2] = -100
    logits, loss = m(idx, targets)
    assert logits.shape == (2, 5, VOCAB)
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss)
    assert m.probe(idx).attn[0].shape == (2, 4, 5, 5)


@pytest.mark.parametrize("qk_init_std", [0.02, 1.0])
def test_probe_attention_rows_sum_to_one_and_mask_is_exact_zero(qk_init_std: float) -> None:
    m = _model(n_layers=2, qk_init_std=qk_init_std).eval()
    out = m.probe(_idx(b=4))
    upper = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    for a in out.attn:
        assert torch.allclose(a.sum(-1), torch.ones(a.shape[:-1]), atol=1e-6)
        assert (a >= 0).all()
        assert (a[..., upper] == 0).all()  # exactly zero, not merely tiny
        if qk_init_std <= 0.02:  # (sharp attention may underflow to 0 on allowed keys)
            assert (a[..., ~upper] > 0).all()


@pytest.mark.parametrize(
    ("norm", "skip", "mlp", "qk_norm"),
    list(
        itertools.product(
            ["pre", "post", "none"],
            [True, False],
            [True, False],
            ["none", "layernorm", "sigma_reparam"],
        )
    ),
)
def test_probe_logits_match_fused_forward(norm: str, skip: bool, mlp: bool, qk_norm: str) -> None:
    m = _model(n_layers=3, norm=norm, skip=skip, mlp=mlp, qk_norm=qk_norm, qk_init_std=0.3).eval()
    idx = _idx(b=3)
    logits, _ = m(idx)
    out = m.probe(idx)
    scale = logits.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(out.logits / scale, logits / scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-4)


def test_hidden_states_start_at_embedding_and_follow_blocks() -> None:
    m = _model(n_layers=3).eval()
    idx = _idx(b=2)
    out = m.probe(idx)
    assert len(out.hidden) == m.cfg.n_layers + 1
    emb = m.tok_emb(idx) + m.pos_emb(torch.arange(SEQ))
    torch.testing.assert_close(out.hidden[0], emb, atol=0, rtol=0)
    with torch.no_grad():
        x = emb
        for layer, block in enumerate(m.blocks, start=1):
            x = block(x)
            torch.testing.assert_close(out.hidden[layer], x, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", ["none", "sigma_reparam"])
@pytest.mark.parametrize("std", [0.02, 0.1, 0.5])
def test_qk_init_std_sets_query_key_weight_std(qk_norm: str, std: float) -> None:
    m = _model(n_layers=2, d_model=64, qk_init_std=std, qk_norm=qk_norm)
    for block in m.blocks:
        for proj in (block.attn.q_proj, block.attn.k_proj):
            measured = proj.weight.detach().std().item()  # 4096 samples: ~1% sampling error
            assert measured == pytest.approx(std, rel=0.05)
        # the value projection keeps the default GPT-2 std
        assert block.attn.v_proj.weight.detach().std().item() == pytest.approx(0.02, rel=0.05)


def _sigma_reparam_rel_errors(std: float) -> list[float]:
    """|spectral_norm(W_hat) / gamma - 1| at init, over 3 seeds x 2 layers x {q, k}."""
    errors = []
    for seed in (0, 1, 2):
        m = _model(seed=seed, n_layers=2, d_model=64, qk_norm="sigma_reparam", qk_init_std=std)
        for block in m.blocks:
            for proj in (block.attn.q_proj, block.attn.k_proj):
                assert isinstance(proj, SigmaReparamLinear)
                exact = torch.linalg.matrix_norm(proj.weight.detach(), ord=2)
                # gamma starts at the exact spectral norm of W
                torch.testing.assert_close(proj.gamma.detach(), exact, rtol=1e-5, atol=0)
                spec = torch.linalg.matrix_norm(proj.effective_weight().detach(), ord=2)
                errors.append(abs(spec.item() / proj.gamma.item() - 1.0))
    return errors


@pytest.mark.parametrize("std", [0.02, 0.3])
def test_sigma_reparam_effective_spectral_norm_is_gamma_at_init(std: float) -> None:
    # u, v start at the exact top singular pair, so at init sigma(W) is exact and W_hat = W.
    errors = _sigma_reparam_rel_errors(std)
    assert max(errors) < 6e-2
    assert sorted(errors)[len(errors) // 2] < 1e-2  # typically much closer


def test_sigma_reparam_effective_spectral_norm_is_gamma_at_init_exactly() -> None:
    assert max(_sigma_reparam_rel_errors(0.3)) < 1e-4


def test_sigma_reparam_gamma_is_trainable() -> None:
    m = _model(n_layers=1, qk_norm="sigma_reparam", qk_init_std=0.2)
    names = dict(m.named_parameters())
    for proj_name in ("q_proj", "k_proj"):
        gamma = names[f"blocks.0.attn.{proj_name}.gamma"]
        assert isinstance(gamma, nn.Parameter) and gamma.requires_grad
    m.train()
    idx = _idx(b=2)
    _, loss = m(idx, idx)
    assert loss is not None
    loss.backward()  # type: ignore[no-untyped-call]
    block = m.blocks[0]
    for proj in (block.attn.q_proj, block.attn.k_proj):
        assert proj.gamma.grad is not None
        assert torch.isfinite(proj.gamma.grad) and proj.gamma.grad.abs().item() > 0
    # gamma alone sets the scale of the effective weight: doubling it doubles ||W_hat||_2
    proj = block.attn.q_proj
    before = torch.linalg.matrix_norm(proj.effective_weight().detach(), ord=2)
    with torch.no_grad():
        proj.gamma.mul_(2.0)
    after = torch.linalg.matrix_norm(proj.effective_weight().detach(), ord=2)
    assert after.item() == pytest.approx(2.0 * before.item(), rel=1e-5)


def test_qk_layernorm_modules_present() -> None:
    m = _model(n_layers=1, qk_norm="layernorm")
    attn = m.blocks[0].attn
    assert isinstance(attn.q_norm, nn.LayerNorm) and isinstance(attn.k_norm, nn.LayerNorm)
    assert attn.q_norm.normalized_shape == (m.cfg.d_head,)
    plain = _model(n_layers=1).blocks[0].attn
    assert isinstance(plain.q_norm, nn.Identity)


@pytest.mark.parametrize(
    ("skip", "mlp"),
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["pure-attention", "attention+mlp", "attention+skip", "full"],
)
def test_dong_variants_are_expressible(skip: bool, mlp: bool) -> None:
    """The four architectures of Dong et al. (2021): block output follows the variant's formula."""
    m = _model(n_layers=2, norm="none", skip=skip, mlp=mlp, qk_init_std=0.3).eval()
    for block in m.blocks:
        assert (block.mlp is not None) == mlp
    idx = _idx(b=2)
    out = m.probe(idx)
    with torch.no_grad():
        for layer, block in enumerate(m.blocks):
            x = out.hidden[layer]
            a = block.attn(x)
            y = x + a if skip else a
            if mlp:
                assert block.mlp is not None
                y = y + block.mlp(y) if skip else block.mlp(y)
            torch.testing.assert_close(out.hidden[layer + 1], y, atol=1e-6, rtol=1e-5)
    logits, _ = m(idx)
    assert torch.isfinite(logits).all()


def test_pure_attention_has_no_mlp_parameters() -> None:
    pure = _model(norm="none", skip=False, mlp=False)
    full = _model(norm="none", skip=True, mlp=True)
    assert not any(".mlp." in n for n, _ in pure.named_parameters())
    assert any(".mlp." in n for n, _ in full.named_parameters())
    assert not any("ln" in n for n, _ in pure.named_parameters())


def test_weight_tying() -> None:
    m = _model()
    assert m.head.weight is m.tok_emb.weight


def test_qk_weights_shapes() -> None:
    m = _model(n_layers=3, n_heads=4, d_model=32)
    qk = m.qk_weights()
    assert len(qk) == 3
    for w_q, w_k in qk:
        assert w_q.shape == (4, 8, 32) and w_k.shape == (4, 8, 32)
    # per-head rows are the rows of the projection weight
    w_q, _ = qk[0]
    torch.testing.assert_close(w_q.reshape(32, 32), m.blocks[0].attn.q_proj.weight)


@pytest.mark.parametrize(("d_model", "n_heads"), [(30, 4), (64, 3), (10, 20)])
def test_config_rejects_width_not_divisible_by_heads(d_model: int, n_heads: int) -> None:
    with pytest.raises(pydantic.ValidationError, match="divisible"):
        ModelConfig(d_model=d_model, n_heads=n_heads)


def test_config_rejects_unknown_fields_and_bad_values() -> None:
    with pytest.raises(pydantic.ValidationError):
        ModelConfig.model_validate({"n_layer": 2})
    with pytest.raises(pydantic.ValidationError):
        ModelConfig(qk_init_std=0.0)
    with pytest.raises(pydantic.ValidationError):
        ModelConfig.model_validate({"norm": "sandwich"})
    assert ModelConfig(d_model=64, n_heads=8).d_head == 8


# --------------------------------------------------------------------------- mlp_init_std


def _gpt_init_before_mlp_init_std(model: GPT) -> None:
    """`GPT._init_weights` as it was before `mlp_init_std` existed (the reference)."""
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding | SigmaReparamLinear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
    for block in model.blocks:
        assert isinstance(block, Block)
        for proj in (block.attn.q_proj, block.attn.k_proj):
            assert isinstance(proj, nn.Linear | SigmaReparamLinear)
            nn.init.normal_(proj.weight, mean=0.0, std=model.cfg.qk_init_std)
            if isinstance(proj, SigmaReparamLinear):
                proj.reset_gamma()


@pytest.mark.parametrize(
    "kw",
    [{}, {"qk_init_std": 0.3, "norm": "post"}, {"qk_norm": "sigma_reparam"}, {"block": "pure"}],
    ids=["default", "qk-init-post", "sigma-reparam", "no-mlp"],
)
def test_default_mlp_init_std_gives_the_model_of_before_bit_for_bit(
    kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    new = _model(seed=5, **kw)
    assert new.cfg.mlp_init_std == 0.02
    monkeypatch.setattr(GPT, "_init_weights", _gpt_init_before_mlp_init_std)
    old = _model(seed=5, **kw)
    new_state, old_state = new.state_dict(), old.state_dict()
    assert new_state.keys() == old_state.keys()
    for name, t in old_state.items():
        assert torch.equal(new_state[name], t), name


def test_mlp_init_std_scales_only_the_mlp_weights() -> None:
    small, big = _model(seed=2), _model(seed=2, mlp_init_std=0.3)
    small_state, big_state = small.state_dict(), big.state_dict()
    for name, t in small_state.items():
        if ".mlp." in name:
            # the same normal draws, scaled: std 0.3 instead of 0.02
            torch.testing.assert_close(big_state[name], t * 15.0, rtol=1e-5, atol=1e-7)
            assert big_state[name].std().item() == pytest.approx(0.3, rel=0.1)
        else:
            assert torch.equal(big_state[name], t), name


def _mlp_jacobian_norm_and_gain(std: float) -> tuple[float, float]:
    """Spectral norm of the MLP's Jacobian and ||MLP(x)|| / ||x|| on LayerNorm-scale tokens."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=1, n_heads=2, d_model=64, d_ff=256, norm="post", mlp_init_std=std)
    block = GPT(cfg, vocab_size=16, seq_len=8).blocks[0]
    assert isinstance(block, Block) and block.mlp is not None
    mlp = block.mlp

    def one_token(v: Tensor) -> Tensor:
        y: Tensor = mlp(v[None])[0]
        return y

    x = torch.nn.functional.layer_norm(
        torch.randn(16, 64, generator=torch.Generator().manual_seed(1)), (64,)
    )
    norms = [
        torch.linalg.matrix_norm(
            torch.autograd.functional.jacobian(one_token, x[i]),  # type: ignore[no-untyped-call]
            ord=2,
        ).item()
        for i in range(4)
    ]
    with torch.no_grad():
        gain = (mlp(x).norm() / x.norm()).item()
    return max(norms), gain


def test_mlp_init_std_moves_the_mlp_away_from_identity_through_layernorm() -> None:
    """At 0.02 the MLP's output is ~3 % of its input (LayerNorm(h + MLP(h)) ~ LayerNorm(h))
    and its Lipschitz constant is ~0.06; at 1/sqrt(d_model) both are O(1) or more."""
    lip_small, gain_small = _mlp_jacobian_norm_and_gain(0.02)
    lip_big, gain_big = _mlp_jacobian_norm_and_gain(0.125)
    assert lip_small < 0.2 and gain_small < 0.05
    assert lip_big > 1.0 and gain_big > 0.5
    assert lip_big / lip_small > 20  # grows as the square of the scale (39x at 6.25x)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_mlp_init_std_is_bounded(bad: float) -> None:
    with pytest.raises(pydantic.ValidationError, match="mlp_init_std"):
        ModelConfig(mlp_init_std=bad)


# ---- bidirectional attention (`causal: false`) ----------------------------------------------


def _np_gelu(x: Any) -> Any:
    import math

    import numpy as np

    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _np_layer_norm(x: Any, w: Any, b: Any) -> Any:
    import numpy as np

    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * w + b


def _np_forward(m: GPT, idx: Tensor, causal: bool) -> tuple[Any, list[Any]]:
    """An independent numpy forward of a Pre-LN GPT with skips and MLPs: (logits, attention
    maps per layer), written from the architecture's definition, not from the model's code."""
    import numpy as np

    p = {n: t.detach().double().numpy() for n, t in m.named_parameters()}
    cfg = m.cfg
    h, dh = cfg.n_heads, cfg.d_head
    t = idx.shape[1]
    x = p["tok_emb.weight"][idx.numpy()] + p["pos_emb.weight"][:t]  # (B, T, D)
    maps = []
    for i in range(cfg.n_layers):
        blk = f"blocks.{i}"
        a = _np_layer_norm(x, p[f"{blk}.ln1.weight"], p[f"{blk}.ln1.bias"])
        q = a @ p[f"{blk}.attn.q_proj.weight"].T
        k = a @ p[f"{blk}.attn.k_proj.weight"].T
        v = a @ p[f"{blk}.attn.v_proj.weight"].T
        out = np.zeros_like(x)
        probs = np.zeros((x.shape[0], h, t, t))
        for hi in range(h):
            sl = slice(hi * dh, (hi + 1) * dh)
            logits = q[..., sl] @ k[..., sl].transpose(0, 2, 1) / np.sqrt(dh)  # (B, T, T)
            if causal:
                logits = np.where(np.tril(np.ones((t, t))) > 0, logits, -np.inf)
            e = np.exp(logits - logits.max(-1, keepdims=True))
            probs[:, hi] = e / e.sum(-1, keepdims=True)
            out[..., sl] = probs[:, hi] @ v[..., sl]
        maps.append(probs)
        x = x + out @ p[f"{blk}.attn.out_proj.weight"].T
        a = _np_layer_norm(x, p[f"{blk}.ln2.weight"], p[f"{blk}.ln2.bias"])
        x = x + _np_gelu(a @ p[f"{blk}.mlp.fc.weight"].T) @ p[f"{blk}.mlp.proj.weight"].T
    x = _np_layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])
    return x @ p["tok_emb.weight"].T, maps


@pytest.mark.parametrize("causal", [True, False])
def test_forward_and_probe_match_an_independent_numpy_model(causal: bool) -> None:
    m = _model(n_layers=2, n_heads=2, norm="pre", causal=causal, qk_init_std=0.5).double().eval()
    idx = _idx(b=2)
    want_logits, want_maps = _np_forward(m, idx, causal)
    logits, _ = m(idx)  # the training path: scaled_dot_product_attention
    out = m.probe(idx)  # the explicit path
    torch.testing.assert_close(logits, torch.from_numpy(want_logits), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(out.logits, torch.from_numpy(want_logits), rtol=1e-9, atol=1e-11)
    for got, want in zip(out.attn, want_maps, strict=True):
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=1e-9, atol=1e-12)
    upper = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    mass_above = sum(float(a[..., upper].sum()) for a in out.attn)
    assert (mass_above == 0.0) if causal else (mass_above > 1.0)


@pytest.mark.parametrize("causal", [True, False])
def test_a_later_token_reaches_earlier_positions_only_without_the_mask(causal: bool) -> None:
    m = _model(n_layers=2, causal=causal, qk_init_std=0.5).eval()
    idx = _idx(b=1)
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % VOCAB
    with torch.no_grad():
        a, _ = m(idx)
        b, _ = m(changed)
    earlier = (a[0, :-1] - b[0, :-1]).abs().max().item()
    assert (earlier == 0.0) if causal else (earlier > 1e-6)
    assert (a[0, -1] - b[0, -1]).abs().max().item() > 1e-6


@pytest.mark.parametrize(
    ("norm", "skip", "mlp"),
    list(itertools.product(["pre", "post", "none"], [True, False], [True, False])),
)
def test_bidirectional_probe_logits_match_the_training_forward(
    norm: str, skip: bool, mlp: bool
) -> None:
    m = _model(n_layers=3, norm=norm, skip=skip, mlp=mlp, causal=False, qk_init_std=0.3).eval()
    idx = _idx(b=3)
    logits, _ = m(idx)
    out = m.probe(idx)
    scale = logits.abs().max().clamp_min(1e-12)
    torch.testing.assert_close(out.logits / scale, logits / scale, atol=1e-5, rtol=0)
