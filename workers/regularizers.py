"""Eigenspectrum regularizers of docs/metrics.md section 4 (penalty version 2).

Both are computed from a head's query/key weights without forming the D x D
QK matrix, so they are cheap enough to add to every training step. They
are differentiable and work on any device and float dtype.

Precision: both are computed in float32 (float64 stays float64) with autocast disabled,
whatever the caller's autocast context. `var = ||W_sym||_F^2 / D - mean^2` is a difference
of two nearly equal numbers when the spectrum is concentrated (the very state the penalty
drives towards); in bfloat16 the Gram products round to 3 significant digits. For W close
to the identity at D = 128 (the draw of tests/workers/test_regularizers.py, seed 11) the
variance came out 2.6e-4 for a true 4.7e-5; over that helper's seeds 0-99 it ranged from
-4.5e-4 to 3.4e-4, negative in 47. The weights are float32 parameters under autocast anyway,
so this costs only the d_h x d_h Gram products running in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from workers.config import RegularizerKind
from workers.metrics import qk_sym_moments

__all__ = [
    "PENALTY_VERSION",
    "RegularizerKind",
    "locater_penalty",
    "model_penalty",
    "spectral_variance_penalty",
    "z_loss",
]

# Version of the penalty definitions below; every trial records the version that trained it.
# 1: locater = ||W_sym||_F^2 / D + (mean - t)^2 (held the eigen-mean at t / 2, not at t).
# 2: locater = var + (mean - t)^2 (the mean over D eigenvalues of (lambda_i - t)^2; its
#    minimum is mean t, var 0 only for one full-width head, d_h = D: see locater_penalty).
PENALTY_VERSION = 2


def _sym_moments_fp32(w_q: Tensor, w_k: Tensor) -> tuple[Tensor, Tensor]:
    """`qk_sym_moments` in float32 or wider, outside any autocast (module docstring: why)."""
    dtype = torch.promote_types(w_q.dtype, torch.float32)
    with torch.autocast(w_q.device.type, enabled=False):
        return qk_sym_moments(w_q.to(dtype), w_k.to(dtype))


def spectral_variance_penalty(w_q: Tensor, w_k: Tensor) -> Tensor:
    """Variance of the QK eigenspectrum (symmetric part) of a head: the `var` of section 3.

    Float32 or wider, computed outside autocast (module docstring).
    """
    mean, sym_sq = _sym_moments_fp32(w_q, w_k)
    return sym_sq - mean.square()


def locater_penalty(w_q: Tensor, w_k: Tensor, target_mean: float) -> Tensor:
    """LocAteR-style (v2): var + (mean - target_mean)^2 of the symmetric part's eigenvalues.

    In the spirit of Bao et al.'s LocAteR ("minimizes the eigenspectrum scale while
    maintaining its mean"), not its exact published form. It equals the mean over the D
    eigenvalues of W_sym of (lambda_i - t)^2, t = target_mean: it pulls every eigenvalue
    towards t. A head's W = w_q^T w_k / sqrt(d_h) has rank <= d_h, so W_sym has at most d_h
    positive and d_h negative eigenvalues, and what t controls depends on the head width:

    - one full-width head (d_h = D, Bao et al.'s setting): the minimum is exactly var = 0,
      mean = t;
    - d_h < D (every multi-head model): the minimum puts d_h eigenvalues at t and the rest
      at 0, so the D-mean tr(W)/D is held at t * d_h / D (two heads: t / 2) with
      var = t^2 (d_h / D)(1 - d_h / D); what is held at t is the mean over the head's rank,
      tr(W)/d_h (`workers.metrics.qk_eig_mean_rank`, stored as `qk_eig_mean_rank`).

    With t = 0 it is ||W_sym||_F^2 / D, plain shrinkage of the symmetric part. (v1 used
    ||W_sym||_F^2 / D = var + mean^2 in place of var, which held a full-width head's mean at
    t / 2.) Float32 or wider, computed outside autocast (module docstring).
    """
    mean, sym_sq = _sym_moments_fp32(w_q, w_k)
    return sym_sq - mean.square() + (mean - target_mean).square()


def model_penalty(
    qk_weights: Sequence[tuple[Tensor, Tensor]], kind: RegularizerKind, target_mean: float = 0.0
) -> Tensor:
    """Mean penalty over every (layer, head); inputs are per-layer (H, d_h, D) weights."""
    if kind == "none":
        raise ValueError("model_penalty called with kind='none'")
    w_q = torch.stack([q for q, _ in qk_weights])  # (L, H, d_h, D)
    w_k = torch.stack([k for _, k in qk_weights])  # (L, H, d_h, D)
    if kind == "spectral_variance":
        return spectral_variance_penalty(w_q, w_k).mean()
    return locater_penalty(w_q, w_k, target_mean).mean()


def z_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """mean_t (log Z_t)^2 over the positions that have a target (z-loss, docs/metrics.md
    section 9, without its coefficient): logits (..., B, T, V), targets (..., B, T) with -100
    where there is none; the result keeps the leading dims (a fused model's member axis).

    In float32 or wider with autocast disabled, as PaLM and Wortsman et al. compute it: the
    squared log-normaliser of large logits loses its digits in bfloat16. A position without
    a target contributes nothing (not 0 * an overflowing term).
    """
    with torch.autocast(logits.device.type, enabled=False):
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        log_z = torch.logsumexp(wide, dim=-1)  # (..., B, T)
        keep = targets != -100
        sq = torch.where(keep, log_z.square(), torch.zeros_like(log_z))
        return sq.sum(dim=(-2, -1)) / keep.sum(dim=(-2, -1)).to(sq.dtype)
