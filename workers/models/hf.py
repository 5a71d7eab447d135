"""`model.kind: hf`: a Hugging Face `transformers` causal LM built from a config, behind the
engine's protocol (workers/models/base.py; METRICS.md section 10).

Built with `AutoConfig.for_model` + `AutoModelForCausalLM.from_config`: nothing is downloaded
(`HF_HUB_OFFLINE=1`), no code travels with the config. Training runs the model's SDPA
attention. At evaluations, `probe` switches the model to `qkscope_probe`, an attention function
registered with `transformers.AttentionInterface`, with its mask function registered beside it
under the same name in `AttentionMaskInterface` (without that, transformers hands an unknown
implementation no mask at all). The function receives query (B, H, T, d_h) and key
(B, H_kv, S, d_h) after QK norm and rotary, the model's own mask and `scaling`; it computes the
attention explicitly, records q, k (per query head: head h reads key head h // (H / H_kv)) and
the probabilities, and returns the same output as the fast path.

The QK eigenspectrum's rows come from a small per-family table (`_layout`): the q/k projection
rows (split out of GPT-2's fused `c_attn`), the per-dimension QK-norm gains (Qwen3: one (d_h,)
norm shared by all heads; OLMo 2: one norm over all heads, sliced per head) and the layer's
`scaling`, folded into the query rows so that `w_q[h]^T w_k[h] / sqrt(d_h)` is
`W_h = w_q,h^T diag(g_q,h g_k,g(h)) w_k,g(h) * scaling`. Biases (attention_bias, GPT-2's
c_attn bias) are not part of the bilinear form and are left out.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.hf_families import HF_FAMILIES
from workers.models.base import ProbeOutput, QKModel

if TYPE_CHECKING:
    from workers.config_sections import HFModelSpec

__all__ = ["PROBE_ATTENTION", "HFModel", "register_probe_attention"]

PROBE_ATTENTION = "qkscope_probe"
"""The name the probing attention function and its mask function are registered under."""
TRAIN_ATTENTION = "sdpa"


@dataclass
class _Record:
    q: Tensor  # (B, H, T, d_h), as the attention function received it
    k: Tensor  # (B, H, S, d_h), key head g(h) for query head h
    attn: Tensor  # (B, H, T, S), float32 or wider, masked entries exactly 0
    scaling: float


_RECORDS: list[_Record] | None = None  # set only while `HFModel.probe` runs


def _probe_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Explicit attention that records what it saw (the model's mask is a bool (B, 1, T, S),
    True where a query may attend: the mask function registered beside this one)."""
    if attention_mask is None:
        raise RuntimeError("qkscope_probe got no attention mask: its mask function is missing")
    n_rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(n_rep, dim=1)  # (B, H, S, d_h): query head h reads h // n_rep
    v = value.repeat_interleave(n_rep, dim=1)  # (B, H, S, d_h)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    logits = (query @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = logits.masked_fill(~attention_mask[..., : k.shape[-2]], float("-inf"))
    attn = logits.softmax(dim=-1)  # (B, H, T, S)
    out = (attn.to(v.dtype) @ v).transpose(1, 2).contiguous()  # (B, T, H, d_h)
    if _RECORDS is not None:
        _RECORDS.append(_Record(q=query, k=k, attn=attn, scaling=scale))
    return out, attn


def _probe_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """The boolean SDPA mask, never skipped (a causal model must not hand the probe None)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    mask: Tensor | None = sdpa_mask(*args, **kwargs)
    return mask


def register_probe_attention() -> None:
    """Register `qkscope_probe` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE_ATTENTION, _probe_attention)
    AttentionMaskInterface.register(PROBE_ATTENTION, _probe_mask)


def _t(x: Any) -> Tensor:
    """A transformers module's tensor, typed (its modules are untyped)."""
    assert isinstance(x, Tensor)
    return x


@dataclass
class _Layer:
    """One layer's attention as the family lays it out."""

    attn: Any  # the attention module; has `.scaling`
    w_q: Callable[[], Tensor]  # (H, d_h, D)
    w_k: Callable[[], Tensor]  # (H_kv, d_h, D)
    g_q: Callable[[], Tensor] | None  # broadcastable to (H, d_h); None: no QK norm
    g_k: Callable[[], Tensor] | None  # broadcastable to (H_kv, d_h)
    input_norm: nn.Module | None  # the norm the attention reads (Pre-LN), else None


def _layout(model_type: str, net: Any, heads: int, kv_heads: int, d_h: int) -> list[_Layer]:
    """The per-family weight layout table (module docstring)."""
    if model_type == "gpt2":
        layers = []
        for block in net.transformer.h:
            c_attn = block.attn.c_attn  # Conv1D: y = x @ weight + bias, weight (D, 3 D)
            d = c_attn.weight.shape[0]

            def w_q(c: Any = c_attn, d: int = d) -> Tensor:
                return _t(c.weight[:, :d].t().reshape(heads, d_h, d))

            def w_k(c: Any = c_attn, d: int = d) -> Tensor:
                return _t(c.weight[:, d : 2 * d].t().reshape(heads, d_h, d))

            layers.append(_Layer(block.attn, w_q, w_k, None, None, block.ln_1))
        return layers
    layers = []
    for block in net.model.layers:
        att = block.self_attn

        def lq(a: Any = att) -> Tensor:
            w = a.q_proj.weight
            return _t(w.reshape(heads, d_h, w.shape[-1]))

        def lk(a: Any = att) -> Tensor:
            w = a.k_proj.weight
            return _t(w.reshape(kv_heads, d_h, w.shape[-1]))

        g_q = g_k = None
        if hasattr(att, "q_norm"):
            if model_type == "olmo2":  # one norm over all heads' (H d_h): sliced per head

                def g_q(a: Any = att) -> Tensor:
                    return _t(a.q_norm.weight.reshape(heads, d_h))

                def g_k(a: Any = att) -> Tensor:
                    return _t(a.k_norm.weight.reshape(kv_heads, d_h))

            else:  # qwen3: one (d_h,) norm shared by every head

                def g_q(a: Any = att) -> Tensor:
                    return _t(a.q_norm.weight.reshape(1, d_h))

                def g_k(a: Any = att) -> Tensor:
                    return _t(a.k_norm.weight.reshape(1, d_h))

        pre = getattr(block, "input_layernorm", None)  # OLMo 2 norms after the attention
        layers.append(_Layer(att, lq, lk, g_q, g_k, pre))
    return layers


class HFModel(QKModel):
    """An allow-listed transformers family from a config (module docstring)."""

    def __init__(self, spec: HFModelSpec, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModelForCausalLM

        register_probe_attention()
        family = HF_FAMILIES[spec.model_type]
        config = AutoConfig.for_model(
            spec.model_type,
            **spec.config,
            vocab_size=vocab_size,
            # no special tokens: a task's ids carry no meaning transformers should know of
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        positions = getattr(config, family.positions)
        if positions < seq_len:
            raise ValueError(
                f"model.hf.config.{family.positions} ({positions}) is shorter than the task's "
                f"seq_len ({seq_len})"
            )
        self.model_type = spec.model_type
        self.net = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation=TRAIN_ATTENTION, dtype=torch.float32
        )
        heads = int(getattr(config, family.heads))
        kv_heads = int(getattr(config, family.kv_heads)) if family.kv_heads else heads
        width = int(getattr(config, family.width))
        d_h = getattr(config, "head_dim", None) or width // heads
        self.n_heads, self.n_kv_heads, self.d_head = heads, kv_heads, int(d_h)
        self.layers = _layout(spec.model_type, self.net, heads, kv_heads, self.d_head)

    @property
    def causal(self) -> bool:
        return True

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, V) and, with targets (-100 = ignored, already shifted by the task),
        the mean cross-entropy in float32 or wider (the model's own loss would shift again)."""
        logits: Tensor = self.net(input_ids=idx, use_cache=False).logits  # (B, T, V)
        loss = None
        if targets is not None:
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(
                wide.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100
            )
        return logits, loss

    @contextmanager
    def _probing(self) -> Iterator[list[_Record]]:
        global _RECORDS
        records: list[_Record] = []
        self.net.set_attn_implementation(PROBE_ATTENTION)
        _RECORDS = records
        try:
            yield records
        finally:
            _RECORDS = None
            self.net.set_attn_implementation(TRAIN_ATTENTION)

    @torch.no_grad()
    def probe(self, idx: Tensor) -> ProbeOutput:
        with self._probing() as records:
            out = self.net(input_ids=idx, output_hidden_states=True, use_cache=False)
        if len(records) != len(self.layers):
            raise RuntimeError(
                f"the probe saw {len(records)} attention calls for {len(self.layers)} layers"
            )
        scales = [r.scaling for r in records]
        return ProbeOutput(
            logits=out.logits,
            attn=[r.attn for r in records],
            hidden=list(out.hidden_states),
            qk=[(r.q, r.k) for r in records],
            scale=scales[0],
            scales=None if len(set(scales)) == 1 else scales,
        )

    def qk_weights(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer, (H, d_h, D) rows with gains and scaling folded into the query rows
        (module docstring); key rows repeated per query head."""
        n_rep = self.n_heads // self.n_kv_heads
        rows = []
        for layer in self.layers:
            w_q = layer.w_q()  # (H, d_h, D)
            w_k = layer.w_k().repeat_interleave(n_rep, dim=0)  # (H, d_h, D)
            gain = torch.ones((), dtype=w_q.dtype, device=w_q.device)
            if layer.g_q is not None and layer.g_k is not None:
                g_k = layer.g_k()
                g_k = g_k.repeat_interleave(n_rep, dim=0) if g_k.shape[0] > 1 else g_k
                gain = layer.g_q() * g_k  # (H or 1, d_h)
            factor = float(layer.attn.scaling) * math.sqrt(self.d_head)
            rows.append((w_q * (gain * factor)[..., None], w_k))
        return rows

    def qk_input_gains(self) -> list[Tensor | None]:
        gains: list[Tensor | None] = []
        for layer in self.layers:
            weight = getattr(layer.input_norm, "weight", None)
            gains.append(weight if isinstance(weight, Tensor) else None)
        return gains
