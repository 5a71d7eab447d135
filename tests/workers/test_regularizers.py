"""Tests for workers.regularizers against docs/metrics.md section 4 (penalty version 2).

Penalties are compared with explicit computations from the D x D matrix W = w_q^T w_k / sqrt(d_h)
(built here by a loop) and its eigendecomposition, and their gradients are checked with
torch.autograd.gradcheck in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from workers.regularizers import (
    PENALTY_VERSION,
    locater_penalty,
    model_penalty,
    spectral_variance_penalty,
)

DTYPES = [torch.float32, torch.float64]
SHAPES = [(1, 1), (1, 4), (3, 5), (8, 4), (4, 16)]  # (d_h, D), including d_h > D


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _explicit_w(w_q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    d_h, d = w_q.shape
    w = torch.zeros(d, d, dtype=torch.float64)
    for r in range(d_h):
        w = w + torch.outer(w_q[r].to(torch.float64), w_k[r].to(torch.float64))
    return w / math.sqrt(d_h)


def _explicit_var(w_q: torch.Tensor, w_k: torch.Tensor) -> float:
    w = _explicit_w(w_q, w_k)
    ev = torch.linalg.eigvalsh((w + w.T) / 2)
    return float(((ev - ev.mean()) ** 2).mean().item())


def _explicit_locater(w_q: torch.Tensor, w_k: torch.Tensor, target: float) -> float:
    """v2: variance of the eigenvalues of W_sym plus (mean eigenvalue of W - target)^2."""
    w = _explicit_w(w_q, w_k)
    mean = torch.linalg.eigvals(w).real.mean().item()  # = tr(W) / D
    return _explicit_var(w_q, w_k) + (mean - target) ** 2


def _pair(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(*shape, generator=g, dtype=dtype), torch.randn(
        *shape, generator=g, dtype=dtype
    )


# --------------------------------------------------------------------------- hand values


def test_penalties_hand_values() -> None:
    # d_h = 1, D = 2, w_q = [1, 0], w_k = [1, 2]: W = [[1, 2], [0, 0]].
    # mean = tr / D = 0.5. W_sym = [[1, 1], [1, 0]], ||W_sym||_F^2 = 3 -> / D = 1.5.
    # var = 1.5 - 0.25 = 1.25 (eigenvalues (1 +- sqrt 5)/2: variance 5/4).
    w_q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    w_k = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    assert spectral_variance_penalty(w_q, w_k).item() == pytest.approx(1.25, rel=1e-12)
    # locater (v2) with target 0: 1.25 + 0.25 = 1.5; with target 2: 1.25 + 2.25 = 3.5
    assert locater_penalty(w_q, w_k, 0.0).item() == pytest.approx(1.5, rel=1e-12)
    assert locater_penalty(w_q, w_k, 2.0).item() == pytest.approx(3.5, rel=1e-12)
    assert locater_penalty(w_q, w_k, 0.5).item() == pytest.approx(1.25, rel=1e-12)


def test_penalties_scale_with_sqrt_d_h() -> None:
    # d_h = 4 copies of the same row: W = 4 * outer / sqrt(4) = 2 * outer([1,0],[1,2])
    # -> var 5 (4 x 1.25) and mean 1 (2 x 0.5).
    w_q = torch.tensor([[1.0, 0.0]] * 4, dtype=torch.float64)
    w_k = torch.tensor([[1.0, 2.0]] * 4, dtype=torch.float64)
    assert spectral_variance_penalty(w_q, w_k).item() == pytest.approx(5.0, rel=1e-12)
    assert locater_penalty(w_q, w_k, 0.0).item() == pytest.approx(5.0 + 1.0, rel=1e-12)
    assert locater_penalty(w_q, w_k, 1.0).item() == pytest.approx(5.0, rel=1e-12)


# --------------------------------------------------------------------------- vs explicit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d_h", "d"), SHAPES)
def test_spectral_variance_penalty_vs_eigvalsh(dtype: torch.dtype, d_h: int, d: int) -> None:
    for seed in range(3):
        w_q, w_k = _pair((d_h, d), dtype, seed)
        out = spectral_variance_penalty(w_q, w_k)
        assert out.shape == () and out.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        assert out.item() == pytest.approx(_explicit_var(w_q, w_k), rel=tol, abs=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d_h", "d"), SHAPES)
@pytest.mark.parametrize("target", [0.0, 0.7, -1.3])
def test_locater_penalty_vs_explicit(dtype: torch.dtype, d_h: int, d: int, target: float) -> None:
    w_q, w_k = _pair((d_h, d), dtype, seed=d_h * 31 + d)
    out = locater_penalty(w_q, w_k, target)
    assert out.shape == () and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert out.item() == pytest.approx(_explicit_locater(w_q, w_k, target), rel=tol, abs=tol)


def test_penalties_batched_heads() -> None:
    w_q, w_k = _pair((3, 4, 6), torch.float64, seed=5)  # (H, d_h, D)
    var = spectral_variance_penalty(w_q, w_k)
    loc = locater_penalty(w_q, w_k, 0.4)
    assert var.shape == (3,) and loc.shape == (3,)
    for h in range(3):
        assert var[h].item() == pytest.approx(_explicit_var(w_q[h], w_k[h]), rel=1e-10)
        assert loc[h].item() == pytest.approx(_explicit_locater(w_q[h], w_k[h], 0.4), rel=1e-10)


def test_penalties_non_negative_and_zero_cases() -> None:
    # W = c * I (d_h = D, w_q = w_k = I): var 0, mean c; locater is 0 exactly at target c.
    eye = torch.eye(4, dtype=torch.float64)
    c = 1 / math.sqrt(4)
    assert spectral_variance_penalty(eye, eye).item() == pytest.approx(0.0, abs=1e-14)
    assert locater_penalty(eye, eye, c).item() == pytest.approx(0.0, abs=1e-14)
    assert locater_penalty(eye, eye, 0.0).item() == pytest.approx(c**2, rel=1e-12)
    # w_q = 0: W = 0, both zero at target 0
    z = torch.zeros(2, 4, dtype=torch.float64)
    w = torch.randn(2, 4, generator=_gen(6), dtype=torch.float64)
    assert spectral_variance_penalty(z, w).item() == 0.0
    assert locater_penalty(z, w, 0.0).item() == 0.0
    for seed in range(5):
        w_q, w_k = _pair((3, 5), torch.float64, seed=seed)
        assert spectral_variance_penalty(w_q, w_k).item() >= -1e-12


# --------------------------------------------------------------------------- the minimum (v2)


def _numpy_eigen_moments(w_q: np.ndarray, w_k: np.ndarray) -> tuple[float, float]:
    """(mean, var) of the eigenvalues of the symmetric part of W = w_q^T w_k / sqrt(d_h)."""
    w = w_q.T @ w_k / np.sqrt(w_q.shape[0])
    ev = np.linalg.eigvalsh((w + w.T) / 2)
    return float(ev.mean()), float(ev.var())


@pytest.mark.parametrize(("d_h", "d", "target"), [(4, 4, 0.7), (6, 3, -0.4), (8, 4, 1.5)])
def test_locater_v2_minimum_is_at_target_with_zero_variance(
    d_h: int, d: int, target: float
) -> None:
    """Optimising a small W directly on the v2 penalty lands on mean = target, var ~ 0.

    Checked with numpy's eigenvalues of the symmetric part, independent of the factored
    formulas; the v1 penalty, optimised the same way, stops at mean = target / 2.
    d_h >= D here: with d_h < D, W has rank <= d_h, so W_sym has at most 2 d_h non-zero
    eigenvalues and var = 0 is only reachable at mean = 0.
    """
    assert PENALTY_VERSION == 2
    start = _pair((d_h, d), torch.float64, seed=40 + d_h + d)
    for version, expected_mean in ((2, target), (1, target / 2)):
        w_q, w_k = (t.clone().mul_(0.5).requires_grad_(True) for t in start)
        opt = torch.optim.Adam([w_q, w_k], lr=0.02)
        for _ in range(3000):
            opt.zero_grad()
            loss = locater_penalty(w_q, w_k, target)
            if version == 1:  # v1 = v2 + mean^2 (||W_sym||_F^2 / D = var + mean^2)
                loss = loss + ((w_q * w_k).sum() / (math.sqrt(d_h) * d)) ** 2
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        mean, var = _numpy_eigen_moments(w_q.detach().numpy(), w_k.detach().numpy())
        assert mean == pytest.approx(expected_mean, abs=2e-3), (version, mean, var)
        assert var == pytest.approx(0.0, abs=1e-4), (version, mean, var)
        if version == 2:
            assert locater_penalty(w_q, w_k, target).item() == pytest.approx(0.0, abs=1e-5)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(("d_h", "d"), [(1, 1), (1, 3), (2, 3), (4, 2), (3, 5)])
def test_spectral_variance_penalty_gradcheck(d_h: int, d: int) -> None:
    w_q, w_k = _pair((d_h, d), torch.float64, seed=7 + d_h + d)
    w_q.requires_grad_(True)
    w_k.requires_grad_(True)
    assert torch.autograd.gradcheck(spectral_variance_penalty, (w_q, w_k))


@pytest.mark.parametrize(("d_h", "d"), [(1, 1), (1, 3), (2, 3), (4, 2), (3, 5)])
@pytest.mark.parametrize("target", [0.0, 0.5])
def test_locater_penalty_gradcheck(d_h: int, d: int, target: float) -> None:
    w_q, w_k = _pair((d_h, d), torch.float64, seed=17 + d_h + d)
    w_q.requires_grad_(True)
    w_k.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k: locater_penalty(q, k, target), (w_q, w_k))


def test_penalty_gradients_match_explicit_form() -> None:
    # autograd through the explicit D x D formulas gives the same gradient
    w_q, w_k = _pair((3, 5), torch.float64, seed=8)
    q1 = w_q.clone().requires_grad_(True)
    k1 = w_k.clone().requires_grad_(True)
    q2 = w_q.clone().requires_grad_(True)
    k2 = w_k.clone().requires_grad_(True)
    target = 0.3

    spectral_variance_penalty(q1, k1).backward()  # type: ignore[no-untyped-call]
    w = q2.T @ k2 / math.sqrt(3)
    sym = (w + w.T) / 2
    ev = torch.linalg.eigvalsh(sym)
    ((ev - ev.mean()) ** 2).mean().backward()
    torch.testing.assert_close(q1.grad, q2.grad)
    torch.testing.assert_close(k1.grad, k2.grad)

    for t in (q1, k1, q2, k2):
        t.grad = None
    locater_penalty(q1, k1, target).backward()  # type: ignore[no-untyped-call]
    w = q2.T @ k2 / math.sqrt(3)
    sym = (w + w.T) / 2
    ev = torch.linalg.eigvalsh(sym)
    (((ev - ev.mean()) ** 2).mean() + (torch.trace(w) / 5 - target) ** 2).backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(q1.grad, q2.grad)
    torch.testing.assert_close(k1.grad, k2.grad)


def test_penalties_float32_differentiable() -> None:
    w_q, w_k = _pair((2, 4, 6), torch.float32, seed=9)
    w_q.requires_grad_(True)
    w_k.requires_grad_(True)
    (spectral_variance_penalty(w_q, w_k).sum() + locater_penalty(w_q, w_k, 0.1).sum()).backward()  # type: ignore[no-untyped-call]
    assert w_q.grad is not None and w_k.grad is not None
    assert w_q.grad.dtype == torch.float32
    assert torch.isfinite(w_q.grad).all() and w_q.grad.abs().sum() > 0


# --------------------------------------------------------------------------- model_penalty


def _layers(
    n_layers: int, h: int, d_h: int, d: int, dtype: torch.dtype, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(seed)
    return [
        (
            torch.randn(h, d_h, d, generator=g, dtype=dtype),
            torch.randn(h, d_h, d, generator=g, dtype=dtype),
        )
        for _ in range(n_layers)
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_penalty_spectral_variance_is_mean_over_layers_and_heads(dtype: torch.dtype) -> None:
    layers = _layers(3, 2, 4, 6, dtype, seed=10)
    per_head = [_explicit_var(q[h], k[h]) for q, k in layers for h in range(2)]
    out = model_penalty(layers, "spectral_variance")
    assert out.shape == () and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert out.item() == pytest.approx(sum(per_head) / len(per_head), rel=tol)


@pytest.mark.parametrize("target", [0.0, 0.25])
def test_model_penalty_locater_is_mean_over_layers_and_heads(target: float) -> None:
    layers = _layers(2, 3, 2, 5, torch.float64, seed=11)
    per_head = [_explicit_locater(q[h], k[h], target) for q, k in layers for h in range(3)]
    out = model_penalty(layers, "locater", target_mean=target)
    assert out.item() == pytest.approx(sum(per_head) / len(per_head), rel=1e-10)


def test_model_penalty_default_target_is_zero() -> None:
    layers = _layers(2, 2, 3, 4, torch.float64, seed=12)
    per_head = [_explicit_locater(q[h], k[h], 0.0) for q, k in layers for h in range(2)]
    assert model_penalty(layers, "locater").item() == pytest.approx(
        sum(per_head) / len(per_head), rel=1e-10
    )


def test_model_penalty_single_layer_single_head() -> None:
    layers = _layers(1, 1, 3, 3, torch.float64, seed=13)
    q, k = layers[0]
    assert model_penalty(layers, "spectral_variance").item() == pytest.approx(
        _explicit_var(q[0], k[0]), rel=1e-10
    )


def test_model_penalty_gradcheck() -> None:
    layers = _layers(2, 2, 2, 3, torch.float64, seed=14)
    flat = [t.requires_grad_(True) for pair in layers for t in pair]

    def f(*ts: torch.Tensor) -> torch.Tensor:
        pairs = [(ts[i], ts[i + 1]) for i in range(0, len(ts), 2)]
        return model_penalty(pairs, "spectral_variance") + model_penalty(pairs, "locater", 0.2)

    assert torch.autograd.gradcheck(f, tuple(flat))


def test_model_penalty_none_raises() -> None:
    layers = _layers(1, 2, 2, 3, torch.float64, seed=15)
    with pytest.raises(ValueError):
        model_penalty(layers, "none")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalties_on_cuda_match_cpu() -> None:
    layers = _layers(2, 2, 4, 8, torch.float64, seed=16)
    cuda_layers = [(q.cuda(), k.cuda()) for q, k in layers]
    for kind in ("spectral_variance", "locater"):
        gpu = model_penalty(cuda_layers, kind, 0.1)
        assert gpu.device.type == "cuda"
        torch.testing.assert_close(gpu.cpu(), model_penalty(layers, kind, 0.1))


# --------------------------------------------------------------------------- multi-head minimum


@pytest.mark.parametrize(
    ("d_h", "d", "target"), [(8, 16, 1.0), (4, 16, -0.7), (2, 6, 1.5)], ids=str
)
def test_locater_v2_multi_head_minimum_holds_the_rank_mean_at_target(
    d_h: int, d: int, target: float
) -> None:
    """With d_h < D the v2 minimum is NOT mean = t, var = 0 (docs/metrics.md section 4).

    W = w_q^T w_k / sqrt(d_h) has rank <= d_h, so W_sym has at most d_h eigenvalues of
    either sign; the mean over D of (lambda_i - t)^2 is smallest with d_h eigenvalues at t
    and the rest at 0: D-mean t d_h / D, var t^2 (d_h / D)(1 - d_h / D), and the mean over
    the head's rank tr(W) / d_h equal to t. Optimised directly on W_Q, W_K; every number is
    recomputed from the final weights with numpy's eigvalsh in float64.
    """
    w_q, w_k = (t.mul_(0.3).requires_grad_(True) for t in _pair((d_h, d), torch.float64, 7))
    opt = torch.optim.Adam([w_q, w_k], lr=0.01)
    for _ in range(4000):
        opt.zero_grad()
        locater_penalty(w_q, w_k, target).backward()  # type: ignore[no-untyped-call]
        opt.step()
    q, k = w_q.detach().numpy(), w_k.detach().numpy()
    w = q.T @ k / np.sqrt(d_h)
    ev = np.linalg.eigvalsh((w + w.T) / 2)
    frac = d_h / d
    assert ev.mean() == pytest.approx(target * frac, abs=2e-3)
    assert ev.var() == pytest.approx(target**2 * frac * (1 - frac), abs=2e-3)
    assert np.trace(w) / d_h == pytest.approx(target, abs=4e-3)  # what target_mean holds
    # d_h eigenvalues at t, the other D - d_h at 0
    expected = np.sort(np.r_[np.full(d_h, target), np.zeros(d - d_h)])
    np.testing.assert_allclose(ev, expected, atol=1e-2)


# --------------------------------------------------------------------------- precision


def _near_identity(d: int, eps: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-width head (d_h = D) with W = w_q^T w_k / sqrt(D) close to the identity."""
    g = _gen(seed)
    eye = torch.eye(d, dtype=torch.float64)
    a, b = (torch.randn(d, d, generator=g, dtype=torch.float64) for _ in range(2))
    scale = d**0.25
    return (scale * (eye + eps * a)).float(), (scale * (eye + eps * b)).float()


def test_penalties_under_bf16_autocast_match_float64_numpy() -> None:
    """bf16 autocast (CPU) must not reach the penalty: var = sym_sq - mean^2 cancels there.

    W close to the identity at D = 128: the true eigen-variance is ~5e-5, while the same
    moments with their Gram products in bf16 are off by more than the variance itself
    (docs/metrics.md section 4, "Precision"). The penalties, called inside the autocast
    context, match numpy's float64 eigenvalues of the same float32 weights.
    """
    from workers.metrics import qk_sym_moments

    w_q, w_k = _near_identity(128, 6e-4, seed=11)
    mean_ref, var_ref = _numpy_eigen_moments(w_q.double().numpy(), w_k.double().numpy())
    assert 2e-5 < var_ref < 1e-4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m_bf, sq_bf = qk_sym_moments(w_q, w_k)  # what the training step used to compute
        sv = spectral_variance_penalty(w_q, w_k)
        loc = locater_penalty(w_q, w_k, 0.5)
        mp = model_penalty([(w_q[None], w_k[None])], "spectral_variance")
    naive = float(sq_bf.float() - m_bf.float().square())
    assert abs(naive - var_ref) > var_ref  # the bf16 failure this guards against
    for p in (sv, loc, mp):
        assert p.dtype == torch.float32
    assert float(sv) == pytest.approx(var_ref, rel=2e-2)
    assert float(mp) == pytest.approx(var_ref, rel=2e-2)
    assert float(loc) == pytest.approx(var_ref + (mean_ref - 0.5) ** 2, rel=1e-4)


def test_fused_penalties_under_bf16_autocast_match_float64_numpy() -> None:
    """`FusedGPT.penalties` (the fused training path) is float32 outside autocast too."""
    from workers.config import ModelConfig
    from workers.fused_model import FusedGPT
    from workers.model import GPT

    d = 128
    cfg = ModelConfig(n_layers=1, n_heads=1, d_model=d, d_ff=8)
    models, refs = [], []
    for seed in (3, 4):
        torch.manual_seed(seed)
        model = GPT(cfg, vocab_size=8, seq_len=4)
        w_q, w_k = _near_identity(d, 6e-4, seed=seed)
        params = dict(model.named_parameters())
        with torch.no_grad():
            params["blocks.0.attn.q_proj.weight"].copy_(w_q)
            params["blocks.0.attn.k_proj.weight"].copy_(w_k)
        models.append(model)
        refs.append(_numpy_eigen_moments(w_q.double().numpy(), w_k.double().numpy()))
    fused = FusedGPT.from_models(models, torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pens = fused.penalties(["spectral_variance", "locater"], [0.0, 0.5]).detach()
    assert pens.dtype == torch.float32
    (_, var0), (mean1, var1) = refs
    assert float(pens[0]) == pytest.approx(var0, rel=2e-2)
    assert float(pens[1]) == pytest.approx(var1 + (mean1 - 0.5) ** 2, rel=1e-4)
