"""The one protocol between the trial engine and a model (METRICS.md section 10).

Whatever builds it (the built-in `workers.model.GPT`, a Hugging Face family in
`workers.models.hf`), a model gives the engine:

- `forward(idx, targets)`: logits (B, T, V) and, with targets (-100 = ignored), the mean
  cross-entropy in float32 or wider: the training path, on the model's fast attention;
- `probe(idx)`: at evaluations only, the attention as METRICS.md 10 reads it: per layer the
  probabilities (B, H, T, S), the q and k exactly as they enter the logits (after QK norm and
  rotary; k given per query head), the logits' scale, and the hidden states (L + 1 entries);
- `qk_weights()`: per layer, (H, d_h, D) query and key rows per query head, differentiable,
  such that `w_q[h]^T w_k[h] / sqrt(d_h)` is the head's bilinear form W_h: the eigenspectrum
  probes and the regularizers read these rows and nothing else;
- `qk_input_gains()`: per layer, the gain (D,) of the norm the attention reads (Pre-LN), or
  None;
- `causal`: whether the attention is causal (the probes' masks).

It is a `torch.nn.Module`, so parameters, state dicts (checkpoints), `.to(dtype)` and
train/eval modes are torch's own.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["ProbeOutput", "QKModel"]


@dataclass
class ProbeOutput:
    """What the metrics need from one probe forward."""

    logits: Tensor  # (B, T, V)
    attn: list[Tensor]  # per block: (B, H, T, T), rows sum to 1, masked entries exactly 0
    # (no entry is masked when the model is not causal)
    hidden: list[Tensor]  # L + 1 entries: (B, T, D); 0 is the embedding, l the output of block l
    # per block, q and k as they enter the logits (after QK norm and rotary): (B, H, T, d_h)
    qk: list[tuple[Tensor, Tensor]]
    scale: float  # the logits' scale, 1 / (sqrt(d_h) * attn_temperature)
    # per block, the logits' scale where the layers differ (GPT-2's
    # scale_attn_by_inverse_layer_idx); None: every layer uses `scale`
    scales: list[float] | None = None

    def layer_scale(self, layer: int) -> float:
        """The logits' scale of block `layer` (0-based)."""
        return self.scale if self.scales is None else self.scales[layer]


class QKModel(nn.Module):
    """The written contract (module docstring); subclasses implement every method."""

    @property
    @abstractmethod
    def causal(self) -> bool:
        """Whether the attention is causal."""

    @abstractmethod
    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, V) and, with targets, the mean cross-entropy (float32 or wider)."""

    @abstractmethod
    def probe(self, idx: Tensor) -> ProbeOutput:
        """The evaluation forward with attention read explicitly (no gradient)."""

    @abstractmethod
    def qk_weights(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the (H, d_h, D) query and key rows per query head."""

    @abstractmethod
    def qk_input_gains(self) -> list[Tensor | None]:
        """Per layer, the gain (D,) of the norm before the attention, or None."""
