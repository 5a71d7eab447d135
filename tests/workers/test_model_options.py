"""The Llama-style model options and Wortsman et al.'s interventions (issue 34), each checked
against an independent computation written here from its definition: RMSNorm wherever a norm
stands (and as the QK norm), rotary position embeddings (by explicit 2-D rotations, and the
relative-position property), SwiGLU, sigma-reparam of every linear layer, z-loss, and AdamW
with weight decay independent of the learning rate. Defaults build exactly today's model.

Fused members with these options equal the same trials alone: tests/workers/test_fused.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from tests.workers.helpers import Recorder, tiny
from workers.config import ModelConfig
from workers.engine import make_optimizer
from workers.model import GPT, SigmaReparamLinear, apply_rotary, rotary_tables
from workers.regularizers import z_loss
from workers.trial import run_trial

VOCAB, SEQ = 24, 12


def _model(seed: int = 0, **kw: Any) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig.model_validate({"n_layers": 2, "n_heads": 2, "d_model": 16, "d_ff": 32, **kw})
    return GPT(cfg, vocab_size=VOCAB, seq_len=SEQ)


def _idx(b: int = 3, t: int = SEQ, seed: int = 1) -> Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def test_defaults_build_the_same_model_as_before() -> None:
    """The default options are today's model: the same modules, names and initial weights as
    the model spelled with every default explicitly (and no RMSNorm, rotary, gate)."""
    a = _model()
    b = _model(norm_type="layernorm", position="learned", mlp_type="gelu", sigma_reparam="none")
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert isinstance(a.pos_emb, nn.Embedding)
    assert not any(isinstance(m, nn.RMSNorm | SigmaReparamLinear) for m in a.modules())
    assert a.blocks[0].mlp.fc.weight.shape == (32, 16)


def test_rmsnorm_stands_wherever_a_norm_does_and_computes_x_over_rms() -> None:
    m = _model(norm_type="rmsnorm", qk_norm="rmsnorm").double()
    norms = [mod for mod in m.modules() if isinstance(mod, nn.RMSNorm)]
    # ln1, ln2 per block, ln_f, and q_norm, k_norm per block
    assert len(norms) == 2 * 2 + 1 + 2 * 2
    assert not any(isinstance(mod, nn.LayerNorm) for mod in m.modules())
    ln = m.blocks[0].ln1
    with torch.no_grad():
        ln.weight.normal_()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    xs, w = x.numpy(), ln.weight.detach().numpy()
    eps = torch.finfo(torch.float64).eps  # torch.nn.RMSNorm's default
    want = np.zeros_like(xs)
    for i in range(3):
        for t in range(5):
            rms = math.sqrt(sum(float(v) ** 2 for v in xs[i, t]) / 16 + eps)
            want[i, t] = xs[i, t] / rms * w
    np.testing.assert_allclose(ln(x).detach().numpy(), want, rtol=1e-12)


def _np_rotate(x: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotary embedding by explicit 2-D rotations: at position p, coordinates (i, i + d/2)
    turn by the angle p / base^(2i/d). x (T, d)."""
    t, d = x.shape
    out = np.zeros_like(x)
    for p in range(t):
        for i in range(d // 2):
            a = p / base ** (2 * i / d)
            c, s = math.cos(a), math.sin(a)
            out[p, i] = c * x[p, i] - s * x[p, i + d // 2]
            out[p, i + d // 2] = s * x[p, i] + c * x[p, i + d // 2]
    return out


def test_rotary_is_the_explicit_rotation_and_keeps_norms() -> None:
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)  # (B, H, T, d_h)
    cos, sin = rotary_tables(7, 8, torch.device("cpu"), torch.float64)
    got = apply_rotary(x, cos, sin)
    for b in range(2):
        for h in range(3):
            np.testing.assert_allclose(got[b, h].numpy(), _np_rotate(x[b, h].numpy()), atol=1e-12)
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))


def test_rotary_logits_depend_on_relative_position_only() -> None:
    """<R_i q, R_j k> = <q, R_{j-i} k>: the same q and k at positions (i, j) and (i+s, j+s)
    give the same logit."""
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cos, sin = rotary_tables(12, 8, torch.device("cpu"), torch.float64)
    qs = apply_rotary(q.expand(12, 8), cos, sin)
    ks = apply_rotary(k.expand(12, 8), cos, sin)
    logits = qs @ ks.T  # (12, 12)
    for shift in (1, 3, 5):
        torch.testing.assert_close(logits[2 + shift, shift], logits[2, 0])
        torch.testing.assert_close(logits[6 + shift, 4 + shift], logits[6, 4])


def test_rotary_model_has_no_position_embedding_and_rotates_q_and_k_after_the_qk_norm() -> None:
    m = _model(position="rotary", qk_norm="layernorm", n_layers=1).double().eval()
    assert m.pos_emb is None and "pos_emb.weight" not in dict(m.named_parameters())
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "q_norm" in n or "k_norm" in n:
                p.normal_()
    idx = _idx(b=1, t=6)
    out = m.probe(idx)
    q, k = out.qk[0]
    # by hand: embedding (no positions), pre-norm, projection, per-head LayerNorm, rotation
    x = m.blocks[0].ln1(m.tok_emb(idx)).detach()
    attn = m.blocks[0].attn
    for name, proj, norm, got in (
        ("q", attn.q_proj, attn.q_norm, q),
        ("k", attn.k_proj, attn.k_norm, k),
    ):
        heads = proj(x).detach().view(1, 6, 2, 8).transpose(1, 2)
        normed = norm(heads).detach()
        for h in range(2):
            want = _np_rotate(normed[0, h].numpy())
            np.testing.assert_allclose(got[0, h].numpy(), want, atol=1e-12, err_msg=name)


def test_swiglu_is_proj_of_silu_gate_times_up() -> None:
    m = _model(mlp_type="swiglu").double()
    mlp = m.blocks[0].mlp
    assert mlp.fc.weight.shape == (64, 16)  # gate and up, d_ff = 32 each
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    w_fc, w_proj = mlp.fc.weight.detach().numpy(), mlp.proj.weight.detach().numpy()
    xs = x.numpy()
    gate, up = xs @ w_fc[:32].T, xs @ w_fc[32:].T
    silu = gate / (1.0 + np.exp(-gate))
    np.testing.assert_allclose(mlp(x).detach().numpy(), (silu * up) @ w_proj.T, rtol=1e-12)


def test_sigma_reparam_all_reparametrises_every_linear_layer_and_starts_unchanged() -> None:
    """Every linear layer of every block is W_hat = gamma / sigma(W) W with gamma = sigma(W)
    at init (so W_hat = W); the tied head is the embedding and stays as it is."""
    m = _model(sigma_reparam="all")
    layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, SigmaReparamLinear)}
    want = {
        f"blocks.{i}.{s}"
        for i in range(2)
        for s in (
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.out_proj",
            "mlp.fc",
            "mlp.proj",
        )
    }
    assert set(layers) == want
    assert not any(isinstance(mod, nn.Linear) for mod in m.blocks.modules())
    for n, layer in layers.items():
        w = layer.weight.detach().double()
        top = torch.linalg.svdvals(w)[0]
        assert float(layer.gamma.detach()) == pytest.approx(float(top), rel=1e-5), n
        torch.testing.assert_close(layer.effective_weight().detach().double(), w, rtol=1e-5, atol=0)


def test_sigma_reparam_all_trains() -> None:
    rec = Recorder()
    cfg = tiny(steps=10, model={"sigma_reparam": "all"})
    out = run_trial(cfg, rec)
    assert out.status == "completed" and out.final_val_loss is not None


def _np_z_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    total, n = 0.0, 0
    b, t, v = logits.shape
    for i in range(b):
        for j in range(t):
            if targets[i, j] == -100:
                continue
            row = [float(x) for x in logits[i, j]]
            m = max(row)
            total += (m + math.log(sum(math.exp(x - m) for x in row))) ** 2
            n += 1
    return total / n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_z_loss_is_the_mean_squared_log_z_over_positions_with_a_target(dtype: torch.dtype) -> None:
    logits = (torch.randn(3, 4, 9, dtype=torch.float64) * 4 + 3).to(dtype)
    targets = torch.randint(0, 9, (3, 4))
    targets[0, :2] = -100
    got = z_loss(logits, targets)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = _np_z_loss(logits.double().numpy(), targets.numpy())
    assert float(got) == pytest.approx(want, rel=1e-5 if dtype != torch.float64 else 1e-12)
    # a leading member axis: each member's own
    stacked = z_loss(torch.stack([logits, logits * 2]), torch.stack([targets, targets]))
    assert stacked.shape == (2,)
    assert float(stacked[1]) == pytest.approx(
        _np_z_loss((logits * 2).double().numpy(), targets.numpy()), rel=1e-5
    )


def test_z_loss_zero_coefficient_is_no_term_and_a_positive_one_pulls_log_z_to_zero() -> None:
    base = tiny(steps=30, eval_every=10, optim={"lr": 0.01, "schedule": "constant"})
    plain, zero, strong = Recorder(), Recorder(), Recorder()
    run_trial(base, plain)
    run_trial(base.model_copy(update={"z_loss_coef": 0.0}), zero)
    out = run_trial(base.model_copy(update={"z_loss_coef": 0.1}), strong)
    assert plain.stream() == zero.stream()  # bit-identical: no 0 * z term
    free = run_trial(base, Recorder())
    assert out.max_abs_output_log_z_ever is not None and free.max_abs_output_log_z_ever is not None
    assert out.max_abs_output_log_z_ever < free.max_abs_output_log_z_ever


@pytest.mark.parametrize("lr", [1e-3, 0.3])
def test_independent_weight_decay_does_not_scale_with_the_learning_rate(lr: float) -> None:
    """With zero gradients AdamW's update is only its decay: coupled multiplies p by
    1 - lr * wd, independent by 1 - wd (times the schedule's multiplier, 1 here), whatever lr."""
    for mode, want in (("coupled", 1 - lr * 0.1), ("independent", 1 - 0.1)):
        cfg = tiny(optim={"lr": lr, "weight_decay": 0.1, "weight_decay_mode": mode})
        model = _model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = make_optimizer(cfg, model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, b in zip(model.parameters(), before, strict=True):
            torch.testing.assert_close(p.detach(), b * want, rtol=1e-6, atol=0), mode


def test_refused_combinations_name_their_field() -> None:
    import pydantic

    cases = [
        ({"model": {"position": "rotary", "d_model": 18, "n_heads": 2}}, ("model", "position")),
        ({"model": {"sigma_reparam": "all", "qk_norm": "sigma_reparam"}}, ("model", "sigma_reparam")),
        ({"model": {"norm_type": "rmsnorm", "norm": "none"}}, ("model", "norm_type")),
        ({"model": {"mlp_type": "swiglu", "block": "pure"}}, ("model", "mlp_type")),
        ({"optim": {"name": "sgd", "weight_decay_mode": "independent"}}, ("optim", "weight_decay_mode")),
        ({"z_loss_coef": -1.0}, ("z_loss_coef",)),
    ]  # fmt: skip
    for over, loc in cases:
        with pytest.raises(pydantic.ValidationError) as e:
            tiny(**over)
        assert e.value.errors()[0]["loc"] == loc, (over, e.value.errors())
