"""Tests for workers.metrics against docs/metrics.md.

Every function is checked against an independent computation: hand-worked numbers, explicit
eigendecompositions (torch.linalg / numpy), or plain-loop reimplementations written here from
the contract's text. Nothing is checked against the implementation itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.metrics import (
    _composite_norm,
    attention_entropy,
    attention_logit_max,
    attention_target_mass,
    attention_top1_mass,
    detect_plateaus,
    ema,
    is_trapped,
    normalized_attention_entropy,
    output_log_z,
    plateau_stats,
    qk_eig_mean_rank,
    qk_eigen_stats,
    qk_eigen_stats_factored,
    qk_matrix,
    qk_sym_moments,
    rank_collapse_ratio,
)

DTYPES = [torch.float32, torch.float64]


def _rtol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-10


def _atol(dtype: torch.dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 1e-12


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- helpers (reference)


def _np_row_entropy(p: np.ndarray) -> float:
    """-sum p log p over one row, with 0 log 0 = 0, by an explicit loop."""
    h = 0.0
    for v in p:
        if v > 0:
            h -= float(v) * math.log(float(v))
    return h


def _causal_attention(b: int, h: int, t: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random causal softmax attention (B, H, T, T): masked positions exactly 0."""
    logits = torch.randn(b, h, t, t, generator=_gen(seed), dtype=torch.float64) * 2.0
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return logits.masked_fill(mask, float("-inf")).softmax(dim=-1).to(dtype)


def _np_composite_norm(m: np.ndarray) -> float:
    rows, cols = m.shape
    col_sums = [sum(abs(float(m[i, j])) for i in range(rows)) for j in range(cols)]
    row_sums = [sum(abs(float(m[i, j])) for j in range(cols)) for i in range(rows)]
    return math.sqrt(max(col_sums) * max(row_sums))


def _np_rank_ratio(x: np.ndarray) -> float:
    mean = x.mean(axis=0, keepdims=True)
    den = _np_composite_norm(x)
    return 0.0 if den == 0 else _np_composite_norm(x - mean) / den


def _explicit_w(w_q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """W = sum_r outer(w_q[r], w_k[r]) / sqrt(d_h), by a loop over head dimensions."""
    d_h, d = w_q.shape
    w = torch.zeros(d, d, dtype=w_q.dtype)
    for r in range(d_h):
        w += torch.outer(w_q[r], w_k[r])
    return w / math.sqrt(d_h)


def _eig_reference(w: torch.Tensor) -> tuple[float, float]:
    """(mean of complex eigenvalues' real parts, population variance of eigvalsh(W_sym))."""
    w64 = w.to(torch.float64)
    mean = torch.linalg.eigvals(w64).real.mean().item()
    sym = (w64 + w64.T) / 2
    ev = torch.linalg.eigvalsh(sym)
    var = ((ev - ev.mean()) ** 2).mean().item()
    return mean, var


# --------------------------------------------------------------------------- 1. attention entropy


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_entropy_uniform_is_log_s(dtype: torch.dtype) -> None:
    b, h, t, s = 2, 3, 4, 5
    attn = torch.full((b, h, t, s), 1.0 / s, dtype=dtype)
    out = attention_entropy(attn)
    assert out.shape == (h,)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out, torch.full((h,), math.log(5), dtype=dtype), rtol=_rtol(dtype), atol=_atol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_entropy_one_hot_is_zero_not_nan(dtype: torch.dtype) -> None:
    attn = torch.zeros(2, 2, 3, 3, dtype=dtype)
    attn[..., 0] = 1.0  # every row puts all mass on key 0; the zeros must give 0 log 0 = 0
    out = attention_entropy(attn)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.zeros(2, dtype=dtype))


def test_attention_entropy_hand_values_per_head() -> None:
    # B = 1, H = 2, T = 2, S = 2.
    # head 0: rows [0.5, 0.5] (H = log 2) and [1, 0] (H = 0)   -> mean log(2) / 2
    # head 1: rows [0.25, 0.75] twice                           -> H = -(.25 ln .25 + .75 ln .75)
    attn = torch.tensor(
        [[[[0.5, 0.5], [1.0, 0.0]], [[0.25, 0.75], [0.25, 0.75]]]], dtype=torch.float64
    )
    h1 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expected = torch.tensor([math.log(2) / 2, h1], dtype=torch.float64)
    torch.testing.assert_close(attention_entropy(attn), expected)


def test_attention_entropy_mean_over_batch_and_queries() -> None:
    # The mean is over batch AND queries (not a sum, not only one of them).
    # batch 0 rows: uniform over 4 (ln 4), one-hot (0); batch 1 rows: uniform over 2 (ln 2), 0.
    attn = torch.zeros(2, 1, 2, 4, dtype=torch.float64)
    attn[0, 0, 0] = 0.25
    attn[0, 0, 1, 2] = 1.0
    attn[1, 0, 0, :2] = 0.5
    attn[1, 0, 1, 3] = 1.0
    expected = (math.log(4) + 0 + math.log(2) + 0) / 4
    assert attention_entropy(attn).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_entropy_random_causal_vs_loops(dtype: torch.dtype) -> None:
    b, h, t = 3, 2, 6
    attn = _causal_attention(b, h, t, dtype, seed=0)
    a = attn.to(torch.float64).numpy()
    expected = [
        np.mean([_np_row_entropy(a[bi, hi, ti]) for bi in range(b) for ti in range(t)])
        for hi in range(h)
    ]
    torch.testing.assert_close(
        attention_entropy(attn), torch.tensor(expected, dtype=dtype), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_normalized_entropy_uniform_causal_is_one(dtype: torch.dtype) -> None:
    t = 7
    attn = torch.zeros(2, 3, t, t, dtype=dtype)
    for i in range(t):
        attn[:, :, i, : i + 1] = 1.0 / (i + 1)  # uniform over the i + 1 visible keys
    out = normalized_attention_entropy(attn, causal=True)
    assert out.shape == (3,)
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "row 0 (n_i = 1) must be left out, not give 0/0"
    torch.testing.assert_close(
        out, torch.ones(3, dtype=dtype), rtol=_rtol(dtype), atol=_atol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_normalized_entropy_one_hot_is_zero(dtype: torch.dtype) -> None:
    attn = torch.zeros(2, 2, 5, 5, dtype=dtype)
    attn[..., 0] = 1.0
    for causal in (True, False):
        out = normalized_attention_entropy(attn, causal=causal)
        torch.testing.assert_close(out, torch.zeros(2, dtype=dtype))


def test_normalized_entropy_causal_row_count_hand() -> None:
    # T = S = 3, causal. n_i = i + 1 = 1, 2, 3.
    # row 0: [1, 0, 0]        n = 1 -> left out
    # row 1: [.5, .5, 0]      H = ln 2, / ln 2 = 1
    # row 2: [1, 0, 0]        H = 0,   / ln 3 = 0
    # mean over the kept rows = (1 + 0) / 2 = 0.5
    # (n_i = S for every row would give (ln2/ln3 + 0 + 0) / 3 or similar; keeping row 0 gives NaN)
    attn = torch.tensor(
        [[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]]], dtype=torch.float64
    )
    out = normalized_attention_entropy(attn, causal=True)
    assert out.item() == pytest.approx(0.5, rel=1e-12)


def test_normalized_entropy_causal_row_count_hand_second() -> None:
    # T = S = 4, causal; kept rows i = 1, 2, 3 with n_i = 2, 3, 4:
    # row 1 one-hot -> 0; row 2 uniform over 2 of 3 keys -> ln2/ln3; row 3 uniform over 4 -> 1.
    attn = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    attn[0, 0, 0, 0] = 1.0
    attn[0, 0, 1, 1] = 1.0
    attn[0, 0, 2, :2] = 0.5
    attn[0, 0, 3, :] = 0.25
    expected = (0.0 + math.log(2) / math.log(3) + 1.0) / 3
    assert normalized_attention_entropy(attn, causal=True).item() == pytest.approx(
        expected, rel=1e-12
    )


def test_normalized_entropy_non_causal_uses_s_for_every_row() -> None:
    # T = 2, S = 4, non-causal: n_i = 4 for both rows (row 0 is kept).
    # row 0 uniform over 4 -> 1; row 1 uniform over 2 keys -> ln2 / ln4 = 0.5.  Mean 0.75.
    attn = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    attn[0, 0, 0] = 0.25
    attn[0, 0, 1, :2] = 0.5
    out = normalized_attention_entropy(attn, causal=False)
    assert out.item() == pytest.approx(0.75, rel=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_normalized_entropy_non_causal_uniform_is_one(dtype: torch.dtype) -> None:
    attn = torch.full((2, 4, 3, 6), 1.0 / 6, dtype=dtype)
    out = normalized_attention_entropy(attn, causal=False)
    torch.testing.assert_close(
        out, torch.ones(4, dtype=dtype), rtol=_rtol(dtype), atol=_atol(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_normalized_entropy_random_causal_vs_loops(dtype: torch.dtype) -> None:
    b, h, t = 2, 3, 8
    attn = _causal_attention(b, h, t, dtype, seed=1)
    a = attn.to(torch.float64).numpy()
    expected = []
    for hi in range(h):
        vals = [
            _np_row_entropy(a[bi, hi, ti]) / math.log(ti + 1)
            for bi in range(b)
            for ti in range(t)
            if ti + 1 > 1
        ]
        expected.append(np.mean(vals))
    out = normalized_attention_entropy(attn, causal=True)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=dtype), rtol=1e-5, atol=1e-6)
    assert ((out >= 0) & (out <= 1 + 1e-6)).all()


def test_normalized_entropy_random_non_causal_vs_loops() -> None:
    b, h, t, s = 2, 2, 3, 5
    attn = (torch.randn(b, h, t, s, generator=_gen(2), dtype=torch.float64) * 3).softmax(-1)
    a = attn.numpy()
    expected = [
        np.mean(
            [_np_row_entropy(a[bi, hi, ti]) / math.log(s) for bi in range(b) for ti in range(t)]
        )
        for hi in range(h)
    ]
    torch.testing.assert_close(
        normalized_attention_entropy(attn, causal=False),
        torch.tensor(expected, dtype=torch.float64),
    )


# --------------------------------------------------------------------------- 2. rank collapse


def test_composite_norm_hand_2x3() -> None:
    # M = [[1, -2, 3], [4, 5, -6]]
    # column abs-sums: 5, 7, 9 -> ||M||_1 = 9;  row abs-sums: 6, 15 -> ||M||_inf = 15
    m = torch.tensor([[[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]]], dtype=torch.float64)
    torch.testing.assert_close(
        _composite_norm(m), torch.tensor([math.sqrt(9 * 15)], dtype=torch.float64)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_collapse_ratio_hand_2x3(dtype: torch.dtype) -> None:
    # X = [[1, -2, 3], [4, 5, -6]], ||X||_{1,inf} = sqrt(9 * 15) (see above).
    # mean token = [2.5, 1.5, -1.5]; res = [[-1.5, -3.5, 4.5], [1.5, 3.5, -4.5]]
    # column abs-sums 3, 7, 9 -> 9; row abs-sums 9.5, 9.5 -> 9.5;  ||res|| = sqrt(9 * 9.5)
    x = torch.tensor([[[1.0, -2.0, 3.0], [4.0, 5.0, -6.0]]], dtype=dtype)
    out = rank_collapse_ratio(x)
    assert out.shape == (1,)
    assert out.dtype == dtype
    expected = math.sqrt(9 * 9.5) / math.sqrt(9 * 15)
    assert out.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_collapse_ratio_rank_one_is_zero(dtype: torch.dtype) -> None:
    v = torch.randn(2, 1, 6, generator=_gen(3), dtype=dtype)
    x = v.expand(2, 5, 6).clone()  # every token the same vector
    out = rank_collapse_ratio(x)
    torch.testing.assert_close(out, torch.zeros(2, dtype=dtype), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_collapse_ratio_all_zero_is_zero_not_nan(dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, 5, generator=_gen(4), dtype=dtype)
    x[1] = 0.0
    out = rank_collapse_ratio(x)
    assert torch.isfinite(out).all(), f"all-zero X_b must give 0, not NaN: {out}"
    assert out[1].item() == 0.0
    assert out[0].item() > 0 and out[2].item() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_collapse_ratio_random_vs_numpy(dtype: torch.dtype) -> None:
    x = torch.randn(4, 7, 3, generator=_gen(5), dtype=dtype) + 0.5
    xs = x.to(torch.float64).numpy()
    expected = torch.tensor([_np_rank_ratio(xs[b]) for b in range(4)], dtype=dtype)
    torch.testing.assert_close(rank_collapse_ratio(x), expected, rtol=1e-5, atol=1e-6)


def test_rank_collapse_ratio_scale_invariant_and_shift_sensitive() -> None:
    x = torch.randn(2, 5, 4, generator=_gen(6), dtype=torch.float64)
    r = rank_collapse_ratio(x)
    torch.testing.assert_close(rank_collapse_ratio(7.5 * x), r)
    # adding a large common vector to every token shrinks the ratio (res unchanged, norm grows)
    shifted = x + 100.0
    assert (rank_collapse_ratio(shifted) < r).all()


# --------------------------------------------------------------------------- 3. QK eigenspectrum


def test_qk_matrix_hand_values() -> None:
    # d_h = 1: W = outer(w_q, w_k) / 1
    w_q = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    w_k = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    torch.testing.assert_close(
        qk_matrix(w_q, w_k), torch.tensor([[3.0, 4.0], [6.0, 8.0]], dtype=torch.float64)
    )
    # d_h = 4, D = 2: W = (sum of 4 outer products) / 2
    w_q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    w_k = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, -1.0], [5.0, 5.0]], dtype=torch.float64)
    # outer products: [[2,0],[0,0]] + [[0,0],[0,2]] + [[1,-1],[1,-1]] + 0 = [[3,-1],[1,1]]
    expected = torch.tensor([[3.0, -1.0], [1.0, 1.0]], dtype=torch.float64) / 2
    torch.testing.assert_close(qk_matrix(w_q, w_k), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d_h", "d"), [(1, 4), (3, 5), (8, 8), (6, 4)])
def test_qk_matrix_gives_the_attention_logits(dtype: torch.dtype, d_h: int, d: int) -> None:
    g = _gen(7)
    w_q = torch.randn(d_h, d, generator=g, dtype=dtype)
    w_k = torch.randn(d_h, d, generator=g, dtype=dtype)
    x = torch.randn(5, d, generator=g, dtype=dtype)  # 5 tokens
    q = x @ w_q.T  # as nn.Linear
    k = x @ w_k.T
    w = qk_matrix(w_q, w_k)
    assert w.shape == (d, d)
    for i in range(5):
        for j in range(5):
            logit = (q[i] @ k[j]) / math.sqrt(d_h)
            bilinear = x[i] @ w @ x[j]
            torch.testing.assert_close(bilinear, logit, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w, _explicit_w(w_q, w_k), rtol=_rtol(dtype), atol=_atol(dtype))


def test_qk_eigen_stats_hand_values() -> None:
    # W = [[1, 2], [0, 3]]: tr = 4, D = 2 -> mean 2.
    # W_sym = [[1, 1], [1, 3]]: eigenvalues 2 +- sqrt(2) -> variance 2.
    # (||W_sym||_F^2 / D - mean^2 = 12 / 2 - 4 = 2.)
    w = torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64)
    mean, var = qk_eigen_stats(w)
    assert mean.item() == pytest.approx(2.0, rel=1e-12)
    assert var.item() == pytest.approx(2.0, rel=1e-12)


def test_qk_eigen_stats_rotation_uses_symmetric_part() -> None:
    # 90-degree rotation: eigenvalues +-i (mean 0); symmetric part is 0 -> var 0.
    w = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=torch.float64)
    mean, var = qk_eigen_stats(w)
    assert mean.item() == pytest.approx(0.0, abs=1e-15)
    assert var.item() == pytest.approx(0.0, abs=1e-15)


def test_qk_eigen_stats_identity_and_scaled_identity() -> None:
    mean, var = qk_eigen_stats(3.0 * torch.eye(5, dtype=torch.float64))
    assert mean.item() == pytest.approx(3.0)
    assert var.item() == pytest.approx(0.0, abs=1e-12)
    # diag(1, 2, 3, 4): mean 2.5, population variance 1.25
    mean, var = qk_eigen_stats(torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)))
    assert mean.item() == pytest.approx(2.5)
    assert var.item() == pytest.approx(1.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 2, 5, 16])
def test_qk_eigen_stats_vs_eigendecomposition(dtype: torch.dtype, d: int) -> None:
    for seed in range(3):
        w = torch.randn(d, d, generator=_gen(100 + seed), dtype=dtype)
        mean, var = qk_eigen_stats(w)
        ref_mean, ref_var = _eig_reference(w)
        assert mean.dtype == dtype and var.dtype == dtype
        assert mean.shape == () and var.shape == ()
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        assert mean.item() == pytest.approx(ref_mean, rel=tol, abs=tol)
        assert var.item() == pytest.approx(ref_var, rel=tol, abs=tol)


def test_qk_eigen_stats_vs_numpy_eig() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 6))
    ev = np.linalg.eigvals(w)
    sym_ev = np.linalg.eigvalsh((w + w.T) / 2)
    mean, var = qk_eigen_stats(torch.from_numpy(w))
    assert mean.item() == pytest.approx(float(ev.real.mean()), rel=1e-10, abs=1e-12)
    assert var.item() == pytest.approx(float(sym_ev.var()), rel=1e-10)


def test_qk_eigen_stats_leading_dims() -> None:
    w = torch.randn(2, 3, 4, 4, generator=_gen(8), dtype=torch.float64)
    mean, var = qk_eigen_stats(w)
    assert mean.shape == (2, 3) and var.shape == (2, 3)
    for a in range(2):
        for b in range(3):
            ref_mean, ref_var = _eig_reference(w[a, b])
            assert mean[a, b].item() == pytest.approx(ref_mean, rel=1e-10, abs=1e-12)
            assert var[a, b].item() == pytest.approx(ref_var, rel=1e-10, abs=1e-12)


FACTORED_SHAPES = [(1, 1, 1), (2, 1, 5), (3, 4, 8), (2, 8, 4), (4, 16, 16), (1, 7, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "d_h", "d"), FACTORED_SHAPES)
def test_qk_eigen_stats_factored_matches_explicit(
    dtype: torch.dtype, h: int, d_h: int, d: int
) -> None:
    g = _gen(9 + h + d_h + d)
    w_q = torch.randn(h, d_h, d, generator=g, dtype=dtype)
    w_k = torch.randn(h, d_h, d, generator=g, dtype=dtype)
    mean, var = qk_eigen_stats_factored(w_q, w_k)
    assert mean.shape == (h,) and var.shape == (h,)
    assert mean.dtype == dtype and var.dtype == dtype
    for i in range(h):
        w = _explicit_w(w_q[i].to(torch.float64), w_k[i].to(torch.float64))
        ref_mean, ref_var = _eig_reference(w)
        tol = 1e-4 if dtype == torch.float32 else 1e-10
        assert mean[i].item() == pytest.approx(ref_mean, rel=tol, abs=tol)
        assert var[i].item() == pytest.approx(ref_var, rel=tol, abs=tol)
        # and against qk_eigen_stats(qk_matrix(...)) in the same dtype
        e_mean, e_var = qk_eigen_stats(qk_matrix(w_q[i], w_k[i]))
        torch.testing.assert_close(mean[i], e_mean, rtol=tol, atol=tol)
        torch.testing.assert_close(var[i], e_var, rtol=tol, atol=tol)


def test_qk_eigen_stats_factored_extra_leading_dims() -> None:
    g = _gen(10)
    w_q = torch.randn(3, 2, 4, 6, generator=g, dtype=torch.float64)  # (L, H, d_h, D)
    w_k = torch.randn(3, 2, 4, 6, generator=g, dtype=torch.float64)
    mean, var = qk_eigen_stats_factored(w_q, w_k)
    assert mean.shape == (3, 2)
    for layer in range(3):
        for head in range(2):
            ref_mean, ref_var = _eig_reference(_explicit_w(w_q[layer, head], w_k[layer, head]))
            assert mean[layer, head].item() == pytest.approx(ref_mean, rel=1e-10, abs=1e-12)
            assert var[layer, head].item() == pytest.approx(ref_var, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("h", "d_h", "d"), FACTORED_SHAPES)
def test_qk_eig_mean_rank_vs_numpy(dtype: torch.dtype, h: int, d_h: int, d: int) -> None:
    """tr(W) / d_h of W = w_q^T w_k / sqrt(d_h), from numpy's eigenvalues in float64.

    The same W as `qk_eig_mean` (whose divisor is D): the two differ by exactly D / d_h.
    """
    g = _gen(30 + h + d_h + d)
    w_q = torch.randn(3, h, d_h, d, generator=g, dtype=dtype)  # (L, H, d_h, D)
    w_k = torch.randn(3, h, d_h, d, generator=g, dtype=dtype)
    got = qk_eig_mean_rank(w_q, w_k)
    assert got.shape == (3, h) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    q64, k64 = w_q.double().numpy(), w_k.double().numpy()
    for layer in range(3):
        for i in range(h):
            w = q64[layer, i].T @ k64[layer, i] / np.sqrt(d_h)
            ref = float(np.linalg.eigvals(w).real.sum()) / d_h  # sum of eigenvalues = tr(W)
            assert got[layer, i].item() == pytest.approx(ref, rel=tol, abs=tol)
    mean, _ = qk_eigen_stats_factored(w_q, w_k)
    torch.testing.assert_close(got * d_h / d, mean, rtol=tol, atol=tol)


def test_qk_eig_mean_rank_hand_values() -> None:
    # d_h = 2, D = 4: w_q = w_k = [[1, 0, 0, 0], [0, 2, 0, 0]] -> W = diag(1, 4, 0, 0) / sqrt(2)
    w = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    assert qk_eig_mean_rank(w, w).item() == pytest.approx(5 / math.sqrt(2) / 2, rel=1e-12)
    mean, _ = qk_eigen_stats_factored(w, w)
    assert mean.item() == pytest.approx(5 / math.sqrt(2) / 4, rel=1e-12)


def test_qk_sym_moments_second_moment() -> None:
    g = _gen(11)
    w_q = torch.randn(5, 7, generator=g, dtype=torch.float64)
    w_k = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mean, sym_sq = qk_sym_moments(w_q, w_k)
    w = _explicit_w(w_q, w_k)
    sym = (w + w.T) / 2
    assert mean.item() == pytest.approx(torch.trace(w).item() / 7, rel=1e-12)
    ev = torch.linalg.eigvalsh(sym)
    # ||W_sym||_F^2 / D = mean of squared eigenvalues of W_sym
    assert sym_sq.item() == pytest.approx((ev**2).mean().item(), rel=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_metrics_on_cuda_match_cpu() -> None:
    g = _gen(12)
    w_q = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    w_k = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    cpu = qk_eigen_stats_factored(w_q, w_k)
    gpu = qk_eigen_stats_factored(w_q.cuda(), w_k.cuda())
    assert gpu[0].device.type == "cuda"
    torch.testing.assert_close(gpu[0].cpu(), cpu[0])
    torch.testing.assert_close(gpu[1].cpu(), cpu[1])
    attn = _causal_attention(2, 2, 5, torch.float32, seed=13)
    torch.testing.assert_close(
        normalized_attention_entropy(attn.cuda()).cpu(), normalized_attention_entropy(attn)
    )
    x = torch.randn(2, 4, 3, generator=g)
    torch.testing.assert_close(rank_collapse_ratio(x.cuda()).cpu(), rank_collapse_ratio(x))


# --------------------------------------------------------------------------- 5. plateaus


def test_detect_plateaus_single_run_window_1() -> None:
    # window 1, rel_tol 0.01. flat k: k=3 (3-3=0), k=4 (3-3=0); k=1,2,5 drop by 1.
    # run 3..4 -> (s[2], s[4]) = (20, 40)
    steps = [0, 10, 20, 30, 40, 50]
    losses = [5.0, 4.0, 3.0, 3.0, 3.0, 2.0]
    assert detect_plateaus(steps, losses, window=1, rel_tol=0.01) == [(20, 40)]


def test_detect_plateaus_non_uniform_steps_window_2() -> None:
    # window 2, rel_tol 0.05:
    # k=2: 10-8=2 >= .5 ; k=3: 9-8=1 >= .45 ; k=4: 8-8=0 flat ; k=5: 8-8=0 flat ;
    # k=6: 8-5=3 ; k=7: 8-4=4.  Run 4..5 -> (s[2], s[5]) = (7, 40).
    steps = [0, 5, 7, 20, 21, 40, 41, 100]
    losses = [10.0, 9.0, 8.0, 8.0, 8.0, 8.0, 5.0, 4.0]
    assert detect_plateaus(steps, losses, window=2, rel_tol=0.05) == [(7, 40)]


def test_detect_plateaus_touching_intervals_merge() -> None:
    # window 2, rel_tol 0.1, losses [5, 10, 5, 1, 5]:
    # k=2: 5-5=0 flat; k=3: 10-1=9 not flat; k=4: 5-5=0 flat.
    # runs give (s0, s2) and (s2, s4): they touch at s2 -> merged (s0, s4).
    steps = [0, 3, 4, 9, 12]
    losses = [5.0, 10.0, 5.0, 1.0, 5.0]
    assert detect_plateaus(steps, losses, window=2, rel_tol=0.1) == [(0, 12)]


def test_detect_plateaus_overlapping_intervals_merge() -> None:
    # window 3, rel_tol 0.1, losses [5, 10, 5, 5, 1, 5]:
    # k=3: 5-5=0 flat; k=4: 10-1=9 not; k=5: 5-5=0 flat.
    # runs give (s0, s3) and (s2, s5): overlapping -> (s0, s5).
    steps = [0, 2, 3, 7, 11, 13]
    losses = [5.0, 10.0, 5.0, 5.0, 1.0, 5.0]
    assert detect_plateaus(steps, losses, window=3, rel_tol=0.1) == [(0, 13)]


def test_detect_plateaus_separate_intervals_stay_separate() -> None:
    # window 1, rel_tol 0.1, losses [5, 5, 1, 1]: k=1 flat, k=2 not, k=3 flat.
    # (s0, s1) and (s2, s3) neither overlap nor touch.
    steps = [0, 10, 20, 30]
    losses = [5.0, 5.0, 1.0, 1.0]
    assert detect_plateaus(steps, losses, window=1, rel_tol=0.1) == [(0, 10), (20, 30)]


def test_detect_plateaus_everything_flat() -> None:
    steps = [1, 2, 4, 8, 16]
    assert detect_plateaus(steps, [2.0] * 5, window=2, rel_tol=0.01) == [(1, 16)]


def test_detect_plateaus_empty_when_nothing_flat() -> None:
    steps = [0, 1, 2, 3, 4]
    losses = [16.0, 8.0, 4.0, 2.0, 1.0]  # halves every step
    assert detect_plateaus(steps, losses, window=1, rel_tol=0.1) == []
    assert detect_plateaus(steps, losses, window=2, rel_tol=0.5) == []
    assert detect_plateaus([], [], window=1, rel_tol=0.1) == []


def test_detect_plateaus_window_not_smaller_than_n() -> None:
    steps = [0, 1, 2]
    losses = [1.0, 1.0, 1.0]
    assert detect_plateaus(steps, losses, window=3, rel_tol=0.1) == []
    assert detect_plateaus(steps, losses, window=10, rel_tol=0.1) == []
    assert detect_plateaus(steps, losses, window=2, rel_tol=0.1) == [(0, 2)]


def test_detect_plateaus_strict_inequality() -> None:
    # 1.0 - 0.5 = 0.5 is not < 0.5 * |1.0|: not flat.
    assert detect_plateaus([0, 1], [1.0, 0.5], window=1, rel_tol=0.5) == []
    assert detect_plateaus([0, 1], [1.0, 0.5], window=1, rel_tol=0.5000001) == [(0, 1)]


def test_detect_plateaus_rising_loss_is_flat() -> None:
    # a rise gives a negative drop, which is < rel_tol * |loss|
    assert detect_plateaus([0, 7], [1.0, 2.0], window=1, rel_tol=0.01) == [(0, 7)]


def test_detect_plateaus_negative_losses_use_abs() -> None:
    # drop 0.005 < 0.01 * |-1| = 0.01 -> flat (without abs the threshold is -0.01: not flat)
    assert detect_plateaus([0, 5], [-1.0, -1.005], window=1, rel_tol=0.01) == [(0, 5)]
    # drop 0.05 >= 0.01 -> not flat
    assert detect_plateaus([0, 5], [-1.0, -1.05], window=1, rel_tol=0.01) == []


def test_detect_plateaus_bad_arguments() -> None:
    with pytest.raises(ValueError):
        detect_plateaus([0, 1, 2], [1.0, 1.0], window=1, rel_tol=0.1)
    with pytest.raises(ValueError):
        detect_plateaus([0, 1], [1.0, 1.0], window=0, rel_tol=0.1)


def _brute_force_plateaus(
    steps: list[int], losses: list[float], window: int, rel_tol: float
) -> list[tuple[int, int]]:
    """Independent reimplementation: each flat point k covers the index edges k-window..k-1;
    merged intervals are the maximal runs of consecutive covered edges (two intervals that share
    an endpoint share no edge but cover consecutive edges, so they merge too)."""
    n = len(losses)
    covered = [False] * max(n - 1, 0)  # edge e joins index e and e + 1
    for k in range(n):
        if k < window:
            continue
        if losses[k - window] - losses[k] < rel_tol * abs(losses[k - window]):
            for e in range(k - window, k):
                covered[e] = True
    out: list[tuple[int, int]] = []
    e = 0
    while e < len(covered):
        if covered[e]:
            first = e
            while e + 1 < len(covered) and covered[e + 1]:
                e += 1
            out.append((steps[first], steps[e + 1]))
        e += 1
    return out


@st.composite
def _series(draw: st.DrawFn) -> tuple[list[int], list[float], int, float]:
    n = draw(st.integers(0, 25))
    gaps = draw(st.lists(st.integers(1, 50), min_size=n, max_size=n))
    start = draw(st.integers(0, 100))
    steps = [start + sum(gaps[: i + 1]) for i in range(n)]
    level = st.integers(-4, 6).map(float)
    value = st.one_of(level, st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False))
    losses = draw(st.lists(value, min_size=n, max_size=n))
    window = draw(st.integers(1, 6))
    rel_tol = draw(st.sampled_from([0.0, 0.01, 0.1, 0.3, 1.0]))
    return steps, losses, window, rel_tol


@settings(max_examples=300, deadline=None)
@given(_series())
def test_detect_plateaus_matches_brute_force(
    case: tuple[list[int], list[float], int, float],
) -> None:
    steps, losses, window, rel_tol = case
    got = detect_plateaus(steps, losses, window, rel_tol)
    assert got == _brute_force_plateaus(steps, losses, window, rel_tol)
    # sorted, disjoint and non-touching
    for (a0, b0), (a1, b1) in zip(got, got[1:], strict=False):
        assert a0 < b0 < a1 < b1


# --------------------------------------------------------------------------- smoothing / stats


def test_ema_hand_values() -> None:
    # s0 = 1; s1 = .5*2 + .5*1 = 1.5; s2 = .5*3 + .5*1.5 = 2.25; s3 = .5*0 + .5*2.25 = 1.125
    assert ema([1.0, 2.0, 3.0, 0.0], 0.5) == pytest.approx([1.0, 1.5, 2.25, 1.125])
    # alpha .25: s0 = 4; s1 = .25*8 + .75*4 = 5; s2 = .25*0 + .75*5 = 3.75
    assert ema([4.0, 8.0, 0.0], 0.25) == pytest.approx([4.0, 5.0, 3.75])
    assert ema([3.0, -1.0, 7.0], 1.0) == pytest.approx([3.0, -1.0, 7.0])
    assert ema([], 0.3) == []


def test_ema_rejects_bad_alpha() -> None:
    for alpha in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            ema([1.0, 2.0], alpha)


def test_plateau_stats_hand_values() -> None:
    intervals = [(0, 10), (20, 50), (60, 100)]
    # last_step 100: (60, 100) is not escaped. escaped: 10 + 30 = 40 steps; longest 40.
    assert plateau_stats(intervals, last_step=100) == {
        "plateau_count": 2,
        "plateau_steps": 40,
        "longest_plateau": 40,
    }
    # last_step 120: all escaped. 10 + 30 + 40 = 80.
    assert plateau_stats(intervals, last_step=120) == {
        "plateau_count": 3,
        "plateau_steps": 80,
        "longest_plateau": 40,
    }
    # the unescaped one is the longest: it still counts for longest_plateau
    assert plateau_stats([(0, 5), (10, 90)], last_step=90) == {
        "plateau_count": 1,
        "plateau_steps": 5,
        "longest_plateau": 80,
    }
    assert plateau_stats([], last_step=10) == {
        "plateau_count": 0,
        "plateau_steps": 0,
        "longest_plateau": 0,
    }


def test_is_trapped_hand_values() -> None:
    iv = [(0, 10), (20, 50)]
    # reaches the end; gap 2.0 - 1.0 = 1.0 > 0.5 * max(1, 1) = 0.5
    assert is_trapped(iv, 50, final_loss=2.0, reference_loss=1.0, rel_gap=0.5)
    # gap exactly 0.5 is not "more than"
    assert not is_trapped(iv, 50, final_loss=1.5, reference_loss=1.0, rel_gap=0.5)
    # last interval ends before the final evaluation: escaped, not trapped
    assert not is_trapped(iv, 60, final_loss=5.0, reference_loss=1.0, rel_gap=0.5)
    assert not is_trapped([], 50, final_loss=5.0, reference_loss=1.0, rel_gap=0.5)
    # no reference at all
    assert not is_trapped(iv, 50, final_loss=5.0, reference_loss=None, rel_gap=0.5)


def test_is_trapped_gap_relative_to_max_abs_reference_and_one() -> None:
    iv = [(0, 50)]
    # reference 0 (known optimum): gap relative to 1 -> threshold 0.5
    assert not is_trapped(iv, 50, final_loss=0.3, reference_loss=0.0, rel_gap=0.5)
    assert is_trapped(iv, 50, final_loss=0.6, reference_loss=0.0, rel_gap=0.5)
    # reference 10: threshold 0.5 * 10 = 5
    assert not is_trapped(iv, 50, final_loss=14.0, reference_loss=10.0, rel_gap=0.5)
    assert is_trapped(iv, 50, final_loss=16.0, reference_loss=10.0, rel_gap=0.5)
    # negative reference -3: threshold 0.5 * 3 = 1.5
    assert is_trapped(iv, 50, final_loss=-1.0, reference_loss=-3.0, rel_gap=0.5)
    assert not is_trapped(iv, 50, final_loss=-2.0, reference_loss=-3.0, rel_gap=0.5)
    # small reference 0.2: threshold 0.5 * max(0.2, 1) = 0.5, not 0.1
    assert not is_trapped(iv, 50, final_loss=0.6, reference_loss=0.2, rel_gap=0.5)
    assert is_trapped(iv, 50, final_loss=0.8, reference_loss=0.2, rel_gap=0.5)


def test_is_trapped_non_finite_final_loss() -> None:
    assert is_trapped([(0, 50)], 50, final_loss=math.inf, reference_loss=1.0, rel_gap=0.5)
    assert is_trapped([(0, 50)], 50, final_loss=math.nan, reference_loss=1.0, rel_gap=0.5)


def test_probe_metrics_report_qk_eig_mean_rank_per_layer_and_head() -> None:
    """The stored series: tr(W_h) / d_h of each head's slice of the model's q/k weights."""
    from workers.model import GPT, ModelConfig
    from workers.trial import probe_metrics

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=16, d_ff=16, qk_init_std=0.3)
    model = GPT(cfg, vocab_size=10, seq_len=6)
    points = probe_metrics(model, torch.randint(0, 10, (2, 6)))
    got = {(p.layer, p.head): p.value for p in points if p.name == "qk_eig_mean_rank"}
    assert len(got) == 2 * 4
    d_h = 4
    params = dict(model.named_parameters())
    for layer in range(1, 3):
        # (D, D) each: the heads' (d_h, D) rows stacked
        q = params[f"blocks.{layer - 1}.attn.q_proj.weight"].detach().double().numpy()
        k = params[f"blocks.{layer - 1}.attn.k_proj.weight"].detach().double().numpy()
        for h in range(4):
            rows = slice(h * d_h, (h + 1) * d_h)
            w = q[rows].T @ k[rows] / np.sqrt(d_h)
            assert got[(layer, h)] == pytest.approx(np.trace(w) / d_h, rel=1e-5, abs=1e-7)


# --------------------------------------------------------------------------- 7. concentration


def _np_top1(a: np.ndarray, causal: bool) -> list[float]:
    """Per head: mean over batch and rows of (max_j a_ij - 1/n_i) / (1 - 1/n_i), n_i > 1 only,
    by explicit loops over the contract's text (n_i = i + 1 + S - T causal, S otherwise)."""
    b, h, t, s = a.shape
    out = []
    for hi in range(h):
        vals = []
        for bi in range(b):
            for ti in range(t):
                n = ti + 1 + (s - t) if causal else s
                if n <= 1:
                    continue
                top = max(float(a[bi, hi, ti, j]) for j in range(s))
                vals.append((top - 1.0 / n) / (1.0 - 1.0 / n))
        out.append(sum(vals) / len(vals))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_top1_mass_uniform_is_zero_and_one_hot_is_one(dtype: torch.dtype) -> None:
    t = 5
    causal_uniform = torch.tril(torch.ones(t, t, dtype=dtype))
    causal_uniform = (causal_uniform / causal_uniform.sum(-1, keepdim=True)).expand(2, 3, t, t)
    torch.testing.assert_close(
        attention_top1_mass(causal_uniform, causal=True), torch.zeros(3, dtype=dtype)
    )
    full_uniform = torch.full((2, 3, t, 7), 1.0 / 7, dtype=dtype)
    torch.testing.assert_close(
        attention_top1_mass(full_uniform, causal=False), torch.zeros(3, dtype=dtype)
    )
    one_hot = torch.zeros(2, 3, t, t, dtype=dtype)
    one_hot[..., 0] = 1.0  # every row on key 0: allowed under the causal mask too
    torch.testing.assert_close(
        attention_top1_mass(one_hot, causal=True), torch.ones(3, dtype=dtype)
    )
    torch.testing.assert_close(
        attention_top1_mass(one_hot, causal=False), torch.ones(3, dtype=dtype)
    )


def test_top1_mass_hand_values_and_first_causal_row_left_out() -> None:
    # T = S = 3, causal: row 0 (n = 1) is left out; row 1 max 0.75 of n 2: (0.75 - 0.5) / 0.5
    # = 0.5; row 2 max 0.5 of n 3: (0.5 - 1/3) / (2/3) = 0.25. Mean 0.375.
    attn = torch.tensor([[[[1.0, 0, 0], [0.25, 0.75, 0], [0.5, 0.25, 0.25]]]], dtype=torch.float64)
    assert attention_top1_mass(attn, causal=True).item() == pytest.approx(0.375)
    # Not causal: every row has n = 3; row 0 (1 - 1/3) / (2/3) = 1, row 1 (0.75 - 1/3) /
    # (2/3) = 0.625, row 2 0.25. Mean 0.625.
    assert attention_top1_mass(attn, causal=False).item() == pytest.approx(0.625)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
def test_top1_mass_random_vs_loops(dtype: torch.dtype, causal: bool) -> None:
    b, h, t, s = 3, 2, 6, 6
    if causal:
        attn = _causal_attention(b, h, t, dtype, seed=11)
    else:
        logits = torch.randn(b, h, t, s, generator=_gen(12), dtype=torch.float64) * 2
        attn = logits.softmax(-1).to(dtype)
    expected = _np_top1(attn.to(torch.float64).numpy(), causal)
    out = attention_top1_mass(attn, causal=causal)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=dtype), rtol=1e-5, atol=1e-6)
    assert ((out >= 0) & (out <= 1)).all()


def test_top1_mass_causal_with_more_keys_than_queries_vs_loops() -> None:
    b, h, t, s = 2, 2, 3, 5
    logits = torch.randn(b, h, t, s, generator=_gen(13), dtype=torch.float64)
    mask = torch.ones(t, s, dtype=torch.bool).triu(1 + s - t)
    attn = logits.masked_fill(mask, float("-inf")).softmax(-1)
    expected = _np_top1(attn.numpy(), causal=True)
    torch.testing.assert_close(
        attention_top1_mass(attn, causal=True), torch.tensor(expected, dtype=torch.float64)
    )


def _np_target_mass(a: np.ndarray, targets: np.ndarray) -> list[float]:
    """Per head: mean over the (b, i) with a target of a[b, h, i, target], by loops."""
    b, h, t, _ = a.shape
    out = []
    for hi in range(h):
        vals = [
            float(a[bi, hi, ti, int(targets[bi, ti])])
            for bi in range(b)
            for ti in range(t)
            if targets[bi, ti] >= 0
        ]
        out.append(sum(vals) / len(vals))
    return out


def test_target_mass_hand_values() -> None:
    attn = torch.tensor(
        [
            [[[0.5, 0.5, 0.0], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4]]],
            [[[0.2, 0.2, 0.6], [0.9, 0.1, 0.0], [0.0, 1.0, 0.0]]],
        ],
        dtype=torch.float64,
    )  # (B=2, H=1, T=3, S=3)
    targets = torch.tensor([[-1, 2, -1], [-1, -1, 1]])  # two queries with a target
    # (0.7 + 1.0) / 2
    assert attention_target_mass(attn, targets).item() == pytest.approx(0.85)


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_mass_random_vs_loops(dtype: torch.dtype) -> None:
    b, h, t = 4, 3, 7
    attn = _causal_attention(b, h, t, dtype, seed=21)
    g = _gen(22)
    targets = torch.randint(0, t, (b, t), generator=g)
    targets[torch.rand(b, t, generator=g) < 0.5] = -1
    targets[0, -1] = 3  # at least one
    expected = _np_target_mass(attn.to(torch.float64).numpy(), targets.numpy())
    out = attention_target_mass(attn, targets)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=dtype), rtol=1e-5, atol=1e-6)


def test_target_mass_uniform_is_one_over_n_and_refuses_what_is_undefined() -> None:
    attn = torch.full((2, 2, 4, 8), 1.0 / 8, dtype=torch.float64)
    targets = torch.full((2, 4), -1)
    targets[:, -1] = torch.tensor([0, 5])
    torch.testing.assert_close(
        attention_target_mass(attn, targets), torch.full((2,), 1.0 / 8, dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="no query has a target"):
        attention_target_mass(attn, torch.full((2, 4), -1))
    with pytest.raises(ValueError, match="targets must be"):
        attention_target_mass(attn, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=">= S"):
        attention_target_mass(attn, torch.full((2, 4), 8))


def test_probe_metrics_store_concentration_per_layer_and_head_vs_numpy() -> None:
    """The stored series: top-1 and target mass of the model's own attention, each checked
    against numpy loops over attention recomputed here from the weights (bidirectional)."""
    from workers.model import GPT, ModelConfig
    from workers.trial import probe_metrics

    torch.manual_seed(3)
    cfg = ModelConfig(
        n_layers=1, n_heads=2, d_model=8, d_ff=8, norm="none", causal=False, qk_init_std=0.7
    )
    model = GPT(cfg, vocab_size=10, seq_len=6).double()
    with torch.no_grad():  # unit-scale embeddings: attention far from uniform
        model.tok_emb.weight.normal_()
        model.pos_emb.weight.normal_()
    x = torch.randint(0, 10, (3, 6))
    targets = torch.full((3, 6), -1)
    targets[:, -1] = torch.tensor([1, 4, 2])
    points = probe_metrics(model, x, targets)
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    emb = params["tok_emb.weight"][x.numpy()] + params["pos_emb.weight"][:6]  # (B, T, D)
    q = emb @ params["blocks.0.attn.q_proj.weight"].T
    k = emb @ params["blocks.0.attn.k_proj.weight"].T
    attn = np.zeros((3, 2, 6, 6))
    for h in range(2):
        qs, ks = q[..., 4 * h : 4 * h + 4], k[..., 4 * h : 4 * h + 4]
        logits = qs @ ks.transpose(0, 2, 1) / 2.0  # sqrt(d_h) = 2
        e = np.exp(logits - logits.max(-1, keepdims=True))
        attn[:, h] = e / e.sum(-1, keepdims=True)
    top1 = _np_top1(attn, causal=False)
    target = _np_target_mass(attn, targets.numpy())
    got = {(p.name, p.head): p.value for p in points if p.layer == 1}
    for h in range(2):
        assert got[("attn_top1_mass", h)] == pytest.approx(top1[h], rel=1e-10)
        assert got[("attn_target_mass", h)] == pytest.approx(target[h], rel=1e-10)
    assert top1[0] > 0.05  # the test is not about near-uniform attention


# --------------------------------------------------------------------------- 9. instability


def _np_logit_max(q: np.ndarray, k: np.ndarray, causal: bool, scale: float) -> list[float]:
    """Per head: max |scale * <q_i, k_j>| over batch, queries and the keys query i may attend
    to (j <= i + S - T under a causal mask), by explicit loops over the contract's text."""
    b, h, t, d = q.shape
    s = k.shape[2]
    out = []
    for hi in range(h):
        best = 0.0
        for bi in range(b):
            for i in range(t):
                for j in range(s):
                    if causal and j > i + (s - t):
                        continue
                    z = scale * sum(
                        float(q[bi, hi, i, c]) * float(k[bi, hi, j, c]) for c in range(d)
                    )
                    best = max(best, abs(z))
        out.append(best)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_attention_logit_max_vs_loops(
    dtype: torch.dtype, causal: bool, scale: float | None
) -> None:
    g = _gen(11)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64).to(dtype)
    want = _np_logit_max(q.double().numpy(), k.double().numpy(), causal, scale or 0.5)
    got = attention_logit_max(q, k, causal=causal, scale=scale)
    assert got.shape == (3,) and got.dtype == dtype
    np.testing.assert_allclose(got.double().numpy(), want, rtol=_rtol(dtype), atol=_atol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_logit_max_causal_leaves_masked_keys_out(dtype: torch.dtype) -> None:
    """A huge logit a causal query may not see (a later key) is not counted; without the mask
    it is. Keys also longer than queries (S > T): the offset S - T as in the entropy."""
    q = torch.zeros(1, 1, 3, 2, dtype=dtype)
    k = torch.zeros(1, 1, 3, 2, dtype=dtype)
    q[0, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    k[0, 0, :, 0] = torch.tensor([1.0, 1.0, 100.0], dtype=dtype)  # key 2: only query 2 sees it
    q[0, 0, 2, 0] = 0.0  # ... and it sees it with a zero logit
    # causal: query 0 sees key 0 (1), query 1 keys 0, 1 (2, 2), query 2 keys 0..2 (0, 0, 0)
    assert attention_logit_max(q, k, causal=True, scale=1.0).tolist() == [2.0]
    assert attention_logit_max(q, k, causal=False, scale=1.0).tolist() == [200.0]
    # S = 4 > T = 3: query i sees keys j <= i + 1
    k4 = torch.zeros(1, 1, 4, 2, dtype=dtype)
    k4[0, 0, :, 0] = torch.tensor([1.0, 1.0, 7.0, -50.0], dtype=dtype)
    want = _np_logit_max(q.double().numpy(), k4.double().numpy(), True, 1.0)
    assert want == [14.0]  # query 1 (2.0) sees key 2 (7.0); key 3 only query 2, at q = 0
    assert attention_logit_max(q, k4, causal=True, scale=1.0).tolist() == want


def _np_log_z(y: np.ndarray) -> float:
    """Mean over batch and positions of log sum_v exp(y_tv), by explicit loops (shifted by the
    row's max for the float64 exponentials)."""
    b, t, v = y.shape
    total = 0.0
    for bi in range(b):
        for ti in range(t):
            row = [float(y[bi, ti, c]) for c in range(v)]
            m = max(row)
            total += m + math.log(sum(math.exp(x - m) for x in row))
    return total / (b * t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_log_z_vs_loops(dtype: torch.dtype) -> None:
    y = (torch.randn(3, 4, 7, generator=_gen(5), dtype=torch.float64) * 3 + 2).to(dtype)
    got = output_log_z(y)
    assert got.shape == () and got.dtype == dtype
    assert float(got) == pytest.approx(_np_log_z(y.double().numpy()), rel=_rtol(dtype))


def test_output_log_z_of_log_probabilities_is_zero_and_shift_adds() -> None:
    y = torch.randn(2, 3, 5, generator=_gen(6), dtype=torch.float64)
    logp = y.log_softmax(dim=-1)
    assert float(output_log_z(logp)) == pytest.approx(0.0, abs=1e-12)
    assert float(output_log_z(logp + 4.5)) == pytest.approx(4.5, abs=1e-12)


def test_probe_metrics_store_logit_max_at_the_models_own_scale_vs_numpy() -> None:
    """The stored layer-1 attn_logit_max: q, k recomputed here from the weights (QK-LayerNorm,
    a temperature), logits by loops; and output_log_z from the model's own logits."""
    from workers.model import GPT, ModelConfig
    from workers.trial import probe_metrics

    torch.manual_seed(4)
    cfg = ModelConfig(
        n_layers=2, n_heads=2, d_model=8, d_ff=8, norm="none", qk_norm="layernorm",
        attn_temperature=0.25, qk_init_std=0.7,
    )  # fmt: skip
    model = GPT(cfg, vocab_size=10, seq_len=6).double()
    with torch.no_grad():  # unit-scale embeddings and a non-trivial QK-LayerNorm affine
        model.tok_emb.weight.normal_()
        model.pos_emb.weight.normal_()
        for n, p in model.named_parameters():
            if "q_norm" in n or "k_norm" in n:
                p.normal_()
    x = torch.randint(0, 10, (3, 6))
    points = probe_metrics(model, x)
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    emb = params["tok_emb.weight"][x.numpy()] + params["pos_emb.weight"][:6]  # (B, T, D)

    def head_norm(z: np.ndarray, name: str) -> np.ndarray:
        mu = z.mean(-1, keepdims=True)
        var = ((z - mu) ** 2).mean(-1, keepdims=True)
        w, b = params[f"blocks.0.attn.{name}.weight"], params[f"blocks.0.attn.{name}.bias"]
        return (z - mu) / np.sqrt(var + 1e-5) * w + b

    q = emb @ params["blocks.0.attn.q_proj.weight"].T
    k = emb @ params["blocks.0.attn.k_proj.weight"].T
    qh = np.stack([head_norm(q[..., 4 * h : 4 * h + 4], "q_norm") for h in range(2)], 1)
    kh = np.stack([head_norm(k[..., 4 * h : 4 * h + 4], "k_norm") for h in range(2)], 1)
    want = _np_logit_max(qh, kh, causal=True, scale=1.0 / (2.0 * 0.25))
    got = {p.head: p.value for p in points if p.name == "attn_logit_max" and p.layer == 1}
    assert len([p for p in points if p.name == "attn_logit_max"]) == 2 * 2
    for h in range(2):
        assert got[h] == pytest.approx(want[h], rel=1e-9)
    assert max(want) > 5.0  # a temperature of 0.25 makes the logits large
    logits = model(x)[0].detach().numpy()
    (log_z,) = [p.value for p in points if p.name == "output_log_z"]
    assert log_z == pytest.approx(_np_log_z(logits), rel=1e-9)
