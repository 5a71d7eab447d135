"""Eigenspectrum regularizers of docs/metrics.md section 4 (penalty version 2).

Both are computed from a head's query/key weights without forming the D x D
QK matrix, so they are cheap enough to add to every training step. They
are differentiable and work on any device and float dtype.
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
]

# Version of the penalty definitions below; every trial records the version that trained it.
# 1: locater = ||W_sym||_F^2 / D + (mean - t)^2 (held the eigen-mean at t / 2, not at t).
# 2: locater = var + (mean - t)^2 (minimum exactly var 0, mean t).
PENALTY_VERSION = 2


def spectral_variance_penalty(w_q: Tensor, w_k: Tensor) -> Tensor:
    """Variance of the QK eigenspectrum (symmetric part) of a head: the `var` of section 3."""
    mean, sym_sq = qk_sym_moments(w_q, w_k)
    return sym_sq - mean.square()


def locater_penalty(w_q: Tensor, w_k: Tensor, target_mean: float) -> Tensor:
    """LocAteR-style (v2): var + (mean - target_mean)^2 of the symmetric part's eigenvalues.

    Shrinks the spread of the eigenspectrum around its mean while holding the mean at
    `target_mean`, in the spirit of Bao et al.'s LocAteR (not its exact published form);
    the minimum is exactly var = 0, mean = target_mean. (v1 used ||W_sym||_F^2 / D =
    var + mean^2 in place of var, which held the mean at target_mean / 2.)
    """
    mean, sym_sq = qk_sym_moments(w_q, w_k)
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
