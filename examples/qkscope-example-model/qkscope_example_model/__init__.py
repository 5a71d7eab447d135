"""A worked example of a qkscope model plug-in: a small attention-only language model.

What a plug-in is (docs/bring-your-model.md): an installed package whose entry point in the
`qkscope.models` group names a factory `build(config, vocab_size, seq_len)` returning a
`workers.models.QKModel`. A study selects it with
`model: {kind: plugin, plugin: {name: tiny-attention, config: {...}}}`; only that data
travels over REST, the code is what the workers have installed.

This model: token and position embeddings, `n_layers` pre-LN blocks of causal multi-head
attention with ONE fused q/k/v projection (so `qk_weights` shows how to split one), a tied
output head. It implements every method of the protocol, so every probe, regularizer and stop
of qkscope works on it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.models import ProbeOutput, QKModel

__all__ = ["TinyAttentionLM", "build"]


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.ln = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # fused q, k, v rows
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.scale = 1.0 / math.sqrt(self.d_head)

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)  # (B, T, D) each
        return tuple(  # type: ignore[return-value]
            z.view(b, t, self.n_heads, self.d_head).transpose(1, 2) for z in (q, k, v)
        )  # (B, H, T, d_h)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return x + self.out(y.transpose(1, 2).flatten(2))

    def probe(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        q, k, v = self.heads(x)
        t = x.shape[1]
        z = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, T)
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        z = z.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), -math.inf)
        attn = z.softmax(-1)
        y = (attn.to(v.dtype) @ v).transpose(1, 2).flatten(2)
        return x + self.out(y), attn, q, k


class TinyAttentionLM(QKModel):
    """An attention-only causal LM implementing qkscope's model protocol."""

    def __init__(self, vocab_size: int, seq_len: int, n_layers: int, n_heads: int, d_model: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    @property
    def causal(self) -> bool:
        return True

    def _embed(self, idx: Tensor) -> Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    def _logits(self, x: Tensor) -> Tensor:
        return self.ln_f(x) @ self.tok.weight.t()  # (B, T, V), tied head

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = self._embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self._logits(x)
        loss = None
        if targets is not None:
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(wide.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    @torch.no_grad()
    def probe(self, idx: Tensor) -> ProbeOutput:
        x = self._embed(idx)
        hidden, attn, qk = [x], [], []
        for block in self.blocks:
            x, a, q, k = block.probe(x)
            hidden.append(x)
            attn.append(a)
            qk.append((q, k))
        scale = self.blocks[0].scale if self.blocks else 1.0
        return ProbeOutput(self._logits(x), attn, hidden, qk, float(scale))

    def qk_weights(self) -> list[tuple[Tensor, Tensor]]:
        rows = []
        for block in self.blocks:
            d = block.qkv.weight.shape[1]
            w_q, w_k, _ = block.qkv.weight.split(d, dim=0)  # (D, D) each: split the fused rows
            h, d_h = block.n_heads, block.d_head
            rows.append((w_q.view(h, d_h, d), w_k.view(h, d_h, d)))  # scale = 1/sqrt(d_h)
        return rows

    def qk_input_gains(self) -> list[Tensor | None]:
        return [block.ln.weight for block in self.blocks]  # pre-LN: the attention reads ln


def build(config: dict[str, Any], vocab_size: int, seq_len: int) -> TinyAttentionLM:
    """The factory the `qkscope.models` entry point names."""
    return TinyAttentionLM(
        vocab_size,
        seq_len,
        n_layers=int(config.get("n_layers", 2)),
        n_heads=int(config.get("n_heads", 2)),
        d_model=int(config.get("d_model", 32)),
    )
