"""The attention-health metrics of docs/metrics.md, one function each.

Every number qkscope stores comes from here, so each function follows the
contract's definition literally (sections in brackets). All take and return
tensors, work on any device and in float32/float64, and add nothing of their
own: smoothing and thresholds are separate, named functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The loss-curve functions need no torch; they live in workers.curves (the runner uses them).
from workers.curves import detect_plateaus, ema, is_trapped, plateau_stats

__all__ = [
    "attention_entropy",
    "attention_logit_max",
    "attention_target_mass",
    "attention_top1_mass",
    "detect_plateaus",
    "ema",
    "is_trapped",
    "normalized_attention_entropy",
    "output_log_z",
    "plateau_stats",
    "qk_eigen_stats",
    "qk_eig_mean_rank",
    "qk_eigen_stats_factored",
    "qk_effective_eigen_stats",
    "qk_matrix",
    "qk_sym_moments",
    "rank_collapse_ratio",
]


def _row_entropy(attn: Tensor) -> Tensor:
    """-sum_j a_ij log a_ij over the last axis, with 0 log 0 = 0."""
    h: Tensor = -torch.special.xlogy(attn, attn).sum(dim=-1)
    return h


def attention_entropy(attn: Tensor) -> Tensor:
    """Per-head mean row entropy of (B, H, T, S) attention, in nats: Tensor[H]. [1]"""
    return _row_entropy(attn).mean(dim=(0, 2))


def _keys_per_row(attn: Tensor, causal: bool) -> Tensor:
    """n_i, the keys query i may attend to: i + 1 (+ S - T) under a causal mask, else S. [1]"""
    t, s = attn.shape[-2], attn.shape[-1]
    if causal:
        return torch.arange(t, device=attn.device, dtype=attn.dtype) + 1 + (s - t)
    return torch.full((t,), float(s), device=attn.device, dtype=attn.dtype)


def normalized_attention_entropy(attn: Tensor, causal: bool = True) -> Tensor:
    """Per-head mean of row entropy / log(keys the row may attend to): Tensor[H] in [0, 1]. [1]

    Under a causal mask query i sees i + 1 keys (offset by S - T when there
    are more keys than queries), without one all S; rows that see a single key are left out.
    """
    n = _keys_per_row(attn, causal)
    keep = n > 1
    ratio = _row_entropy(attn)[..., keep] / torch.log(n[keep])  # (B, H, T')
    return ratio.mean(dim=(0, 2))


def attention_top1_mass(attn: Tensor, causal: bool = True) -> Tensor:
    """Per-head mean of the rescaled largest weight of each row: Tensor[H] in [0, 1]. [7]

    Row i's `m_i = max_j a_ij` becomes `(m_i - 1/n_i) / (1 - 1/n_i)` (n_i as in the
    normalised entropy): 0 is uniform attention, 1 all mass on one key. Rows with n_i = 1 are
    left out. Descriptive concentration, not Bao et al.'s localization.
    """
    n = _keys_per_row(attn, causal)
    keep = n > 1
    inv = 1.0 / n[keep]
    top = attn.amax(dim=-1)[..., keep]  # (B, H, T')
    return ((top - inv) / (1.0 - inv)).mean(dim=(0, 2))


def attention_target_mass(attn: Tensor, targets: Tensor) -> Tensor:
    """Per head, the mean attention mass queries put on the key position they need: Tensor[H].

    `targets` is (B, T) int: for query i of example b the key position that holds the answer
    (0 <= targets < S), negative where the query has none. The mean runs over the queries
    that have one; 1 means attention selects exactly that key, 1/n_i no better than uniform.
    Raises ValueError when no query has a target (the metric is undefined there). [7]
    """
    b, h, t, s = attn.shape
    if targets.shape != (b, t):
        raise ValueError(f"targets must be (B, T) = {(b, t)}, got {tuple(targets.shape)}")
    has = targets >= 0  # (B, T)
    if not bool(has.any()):
        raise ValueError("no query has a target: attention_target_mass is undefined")
    if bool((targets >= s).any()):
        raise ValueError(f"a target position is >= S = {s}")
    idx = targets.clamp(min=0).to(attn.device)[:, None, :, None].expand(b, h, t, 1)
    mass = attn.gather(-1, idx).squeeze(-1)  # (B, H, T)
    w = has.to(attn.device, attn.dtype)[:, None, :]  # (B, 1, T)
    return (mass * w).sum(dim=(0, 2)) / w.sum(dim=(0, 2))


def _composite_norm(m: Tensor) -> Tensor:
    """sqrt(||M||_1 * ||M||_inf) for each (T, D) matrix in a batch: Tensor[B]. [2]"""
    a = m.abs()
    norm_1 = a.sum(dim=-2).amax(dim=-1)  # largest column abs-sum
    norm_inf = a.sum(dim=-1).amax(dim=-1)  # largest row abs-sum
    return torch.sqrt(norm_1 * norm_inf)


def rank_collapse_ratio(x: Tensor) -> Tensor:
    """||res(X_b)||_{1,inf} / ||X_b||_{1,inf} for (B, T, D) tokens: Tensor[B]. [2]

    res subtracts the mean token (as the authors' code does); 0 means every
    token is the same vector. An all-zero X_b gives 0, not NaN.
    """
    res = x - x.mean(dim=-2, keepdim=True)
    num, den = _composite_norm(res), _composite_norm(x)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.zeros_like(den))


def qk_matrix(w_q: Tensor, w_k: Tensor) -> Tensor:
    """The (D, D) bilinear form of one head's logits: w_q^T w_k / sqrt(d_h). [3]"""
    return w_q.transpose(-2, -1) @ w_k / math.sqrt(w_q.shape[-2])


def qk_eigen_stats(w_qk: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, var) of the QK eigenspectrum from an explicit (D, D) matrix. [3]

    mean = tr(W)/D is exact; var is the variance of the real eigenvalues of
    the symmetric part W_sym = (W + W^T)/2, which fixes x^T W x.
    """
    d = w_qk.shape[-1]
    mean = torch.diagonal(w_qk, dim1=-2, dim2=-1).sum(-1) / d
    w_sym = (w_qk + w_qk.transpose(-2, -1)) / 2
    var = w_sym.square().sum(dim=(-2, -1)) / d - mean.square()
    return mean, var


def qk_sym_moments(w_q: Tensor, w_k: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, ||W_sym||_F^2 / D) from (..., d_h, D) weights without forming W. [3]

    ||W_sym||_F^2 = (||W||_F^2 + tr(W^2)) / 2, where ||W||_F^2 =
    <w_q w_q^T, w_k w_k^T> / d_h and tr(W^2) = <C, C^T> / d_h with C = w_k w_q^T:
    everything is a d_h x d_h product, O(d_h^2 D).
    """
    d_h, d = w_q.shape[-2], w_q.shape[-1]
    mean = (w_q * w_k).sum(dim=(-2, -1)) / (math.sqrt(d_h) * d)
    g_q = w_q @ w_q.transpose(-2, -1)  # (..., d_h, d_h)
    g_k = w_k @ w_k.transpose(-2, -1)  # (..., d_h, d_h)
    c = w_k @ w_q.transpose(-2, -1)  # (..., d_h, d_h)
    fro_sq = (g_q * g_k).sum(dim=(-2, -1)) / d_h
    tr_sq = (c * c.transpose(-2, -1)).sum(dim=(-2, -1)) / d_h
    return mean, (fro_sq + tr_sq) / (2 * d)


def qk_eigen_stats_factored(w_q: Tensor, w_k: Tensor) -> tuple[Tensor, Tensor]:
    """`qk_eigen_stats(qk_matrix(w_q, w_k))` for (..., d_h, D) weights, in O(d_h^2 D). [3]"""
    mean, sym_sq = qk_sym_moments(w_q, w_k)
    return mean, sym_sq - mean.square()


def qk_effective_eigen_stats(w_q: Tensor, w_k: Tensor, gain: Tensor) -> tuple[Tensor, Tensor]:
    """`qk_eigen_stats` of the effective form diag(g) W diag(g), in O(d_h^2 D). [3]

    Under Pre-LN the attention reads g * x_hat + b (x_hat the normalised token, g the norm's
    gain), so the bilinear form in x_hat that sets the logits is diag(g) W diag(g), with W =
    `qk_matrix(w_q, w_k)`; it is W with its D columns of w_q and w_k scaled by g, so the
    factored path applies unchanged. `gain`: (D,), broadcast over (..., d_h, D) weights.
    """
    return qk_eigen_stats_factored(w_q * gain, w_k * gain)


def qk_eig_mean_rank(w_q: Tensor, w_k: Tensor) -> Tensor:
    """tr(W) / d_h for (..., d_h, D) weights: the eigen-mean over the head's rank. [3, 4]

    W is the same `qk_matrix(w_q, w_k)` as in `qk_eigen_stats_factored`; only the divisor
    differs (d_h, not D). W has rank <= d_h, so for a multi-head model (d_h < D) this is
    the number the LocAteR-style penalty holds at `target_mean` (its D-mean is held at
    target_mean * d_h / D); with one full-width head (d_h = D) it equals `qk_eig_mean`.
    """
    d_h = w_q.shape[-2]
    return (w_q * w_k).sum(dim=(-2, -1)) / (math.sqrt(d_h) * d_h)


def attention_logit_max(
    q: Tensor, k: Tensor, causal: bool = True, scale: float | None = None
) -> Tensor:
    """Per head, the largest |z_ij| = |scale <q_i, k_j>| over batch, queries and the keys each
    query may attend to: Tensor[H]. [9]

    `q` (B, H, T, d_h) and `k` (B, H, S, d_h) as they enter the logits (after any QK norm and
    rotary embedding); `scale` defaults to 1 / sqrt(d_h), a model with a temperature passes its
    own. Under a causal mask query i sees keys j <= i + (S - T) (as `_keys_per_row` counts
    them); masked logits never enter softmax and are left out. Computed in float32 or wider.
    """
    wide = torch.promote_types(q.dtype, torch.float32)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    z = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * s  # (B, H, T, S)
    mag = z.abs()
    if causal:
        t, n = z.shape[-2], z.shape[-1]
        mask = torch.ones(t, n, dtype=torch.bool, device=z.device).triu(1 + n - t)
        mag = mag.masked_fill(mask, 0.0)  # |z| >= 0: a masked 0 never exceeds a kept value
    return mag.amax(dim=(0, 2, 3))


def output_log_z(logits: Tensor) -> Tensor:
    """Mean over batch and positions of log Z_t = logsumexp_v y_tv of (B, T, V) output logits:
    Tensor[] (0 when the logits are log-probabilities). Float32 or wider. [9]"""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(wide, dim=-1).mean()
