"""Sigma-reparam under bf16 autocast: sigma, its power iteration and the effective weight
W_hat = gamma / sigma * W are computed in float32 with autocast off (issue 46, item 3), in the
single model (`SigmaReparamLinear`) and the fused one (`FusedGPT`) alike.

Each is checked against an independent float64 computation from its definition: sigma against
the top singular value (`torch.linalg.matrix_norm(ord=2)` of a float64 copy of W) and against
u^T W v with the same u, v; one power-iteration step against the same step in float64 from the
same u. Under bf16 autocast the old code rounded all three to bf16 (measured with these
tests: W_hat 5.2e-3 single and 7.0e-3 fused, one power-iteration step's u 2.6e-3 and 2.9e-3;
2.8e-3 in the issue); the tolerance, 1e-5, fails it by 100x or more (now: ~6e-8).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from workers.config import ModelConfig
from workers.fused_model import FusedGPT
from workers.model import GPT, SigmaReparamLinear

VOCAB, SEQ = 32, 8
TOL = 1e-5  # relative; bf16 rounding is ~2e-3
LAYERS = [
    f"blocks.{i}.{s}"
    for i in range(2)
    for s in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc", "mlp.proj")
]


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = ModelConfig.model_validate(
        {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64, "sigma_reparam": "all"}
    )
    return GPT(cfg, vocab_size=VOCAB, seq_len=SEQ)


def _batch(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _rel(got: Tensor, want: Tensor) -> float:
    """Largest absolute difference relative to the largest |want| (float64)."""
    return float((got.detach().double() - want).abs().max() / want.abs().max())


def _power_step64(w: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """One power-iteration step in float64: v = W^T u / |.|, u = W v / |.|."""
    v = F.normalize(w.t() @ u, dim=0)
    return F.normalize(w @ v, dim=0), v


def _check_layer(
    w_hat: Tensor, sigma: Callable[[], Tensor], w: Tensor, gamma: Tensor, u: Tensor, v: Tensor
) -> None:
    """W_hat and sigma of one layer (one member) against float64 computations."""
    w64 = w.detach().double()
    top = torch.linalg.matrix_norm(w64, ord=2)
    assert w_hat.dtype == torch.float32
    # converged: u, v started at the top singular pair and W has not moved
    assert _rel(w_hat, gamma.detach().double() / top * w64) < TOL
    s = sigma()
    assert s.dtype == torch.float32
    assert _rel(s, u.double() @ w64 @ v.double()) < TOL
    assert _rel(s, top) < TOL


def test_single_layer_sigma_and_effective_weight_in_float32_under_bf16_autocast() -> None:
    m = _model(0).train()
    idx = _batch((4, SEQ), 1)
    with _bf16():
        for _ in range(3):  # three training forwards: three power-iteration steps each layer
            logits, _ = m(idx)
        layers = {n: mod for n, mod in m.named_modules() if isinstance(mod, SigmaReparamLinear)}
        assert set(layers) == set(LAYERS)
        for layer in layers.values():
            _check_layer(
                layer.effective_weight(),
                lambda layer=layer: layer.sigma(),  # a lambda: old code had no sigma()
                layer.weight,
                layer.gamma,
                layer.u,
                layer.v,
            )
    # the matmuls that use W_hat still run under autocast
    assert logits.dtype == torch.bfloat16


def test_single_layer_power_iteration_step_in_float32_under_bf16_autocast() -> None:
    layer = _model(0).blocks[0].attn.q_proj
    assert isinstance(layer, SigmaReparamLinear)
    gen = torch.Generator().manual_seed(2)
    layer.u.copy_(
        F.normalize(torch.randn(layer.u.shape, generator=gen), dim=0)
    )  # far from converged
    want_u, want_v = _power_step64(layer.weight.detach().double(), layer.u.double())
    with _bf16():
        layer._power_iteration()
    assert _rel(layer.u, want_u) < TOL and _rel(layer.v, want_v) < TOL


@pytest.mark.parametrize("step_from_random", [False, True])
def test_fused_sigma_power_iteration_and_effective_weight_in_float32_under_bf16_autocast(
    step_from_random: bool,
) -> None:
    models = [_model(0), _model(1)]
    fused = FusedGPT.from_models(models, torch.device("cpu"))
    if step_from_random:  # one step from random u: compare it with the float64 step
        gen = torch.Generator().manual_seed(3)
        for layer in LAYERS:
            u = fused.buffers[layer + ".u"]
            u.copy_(F.normalize(torch.randn(u.shape, generator=gen), dim=1))
        before = {n: fused.buffers[n + ".u"].double().clone() for n in LAYERS}
        with _bf16():
            fused._power_iteration()
        for layer in LAYERS:
            w = fused.params[layer + ".weight"].detach().double()
            for k in range(2):
                want_u, want_v = _power_step64(w[k], before[layer][k])
                assert _rel(fused.buffers[layer + ".u"][k], want_u) < TOL
                assert _rel(fused.buffers[layer + ".v"][k], want_v) < TOL
        return
    idx = _batch((2, 4, SEQ), 4)
    with _bf16():
        for _ in range(3):  # three training forwards: three power-iteration steps
            fused.forward(idx, _batch((2, 4, SEQ), 5))
        for layer in LAYERS:
            w_hat = fused.weight(layer)
            for k in range(2):
                _check_layer(
                    w_hat[k],
                    lambda layer=layer, k=k: fused.sigma(layer)[k],
                    fused.params[layer + ".weight"][k],
                    fused.params[layer + ".gamma"][k],
                    fused.buffers[layer + ".u"][k],
                    fused.buffers[layer + ".v"][k],
                )
