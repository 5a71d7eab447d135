"""A small decoder-only transformer whose attention health qkscope studies.

nanoGPT-shaped, with the switches the two papers need: residual connections
and MLPs on or off (the four variants of Dong et al. 2021, plus the authors'
attention + MLP variant whose MLP keeps its own skip), LayerNorm placement,
QK normalisation baselines (QK-LayerNorm, sigma-reparam of Zhai et al. 2023),
the init scale of the query/key projections, the most direct knob on the QK
eigenspectrum at initialisation (Bao et al. 2024), and the init scale of the MLP
weights (`mlp_init_std`: Dong et al.'s MLP argument needs MLPs with a large
Lipschitz constant, which GPT's std 0.02 does not give).

The Llama-style options that the people who train large models use, and the interventions
Wortsman et al. 2023 compare (issue 34), each off by default so the default model is exactly
the GPT-2-style block above: RMSNorm wherever a norm stands (`norm_type`, and `qk_norm:
rmsnorm`), rotary position embeddings on q and k after the QK norm (`position: rotary`, no
position embedding then), a SwiGLU MLP (`mlp_type`), and sigma-reparam of every linear layer
of every block (`sigma_reparam: all`). z-loss and the optimizer's decay form are training
options (workers/engine.py, workers/regularizers.py).

`GPT.forward` is the training path (fused `scaled_dot_product_attention`);
`GPT.probe` recomputes attention explicitly and returns every layer's attention
probabilities, hidden states and the q, k its logits came from, for the metrics. No I/O
lives here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.config import BLOCK_PRESETS, BlockPreset, ModelConfig
from workers.models.base import ProbeOutput, QKModel

__all__ = [
    "BLOCK_PRESETS",
    "GPT",
    "ROPE_BASE",
    "BlockPreset",
    "ModelConfig",
    "ProbeOutput",
    "SigmaReparamLinear",
    "apply_rotary",
    "float32_or_wider",
    "make_norm",
    "no_autocast",
    "rotary_tables",
]

ROPE_BASE = 10000.0
"""The base of the rotary embeddings' frequencies (RoFormer, Llama)."""


def rotary_tables(
    t: int, d_head: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, two (T, d_head) tables: position p, pair i turns by
    p / ROPE_BASE^(2i / d_head), the two halves of a head holding the pairs' two coordinates
    (the rotate-half form). Computed in float64, rounded once to `dtype`."""
    inv = ROPE_BASE ** -(
        torch.arange(0, d_head, 2, dtype=torch.float64, device=device) / d_head
    )  # (d_h / 2,)
    ang = torch.arange(t, dtype=torch.float64, device=device)[:, None] * inv[None]  # (T, d_h/2)
    ang = torch.cat([ang, ang], dim=-1)  # (T, d_h)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each head's (x_i, x_{i + d_h/2}) pairs by the position's angles: x (..., T, d_h)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def float32_or_wider(t: Tensor) -> Tensor:
    """`t` in float32, or as it is when wider (float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def no_autocast(t: Tensor) -> torch.autocast:
    """A context that disables autocast on `t`'s device (for the computations that must not
    be rounded to bf16: sigma-reparam's sigma and power iteration)."""
    return torch.autocast(t.device.type, enabled=False)


def make_norm(kind: str, d: int) -> nn.Module:
    """A LayerNorm (weight and bias) or an RMSNorm (weight only) over the last `d` features."""
    return nn.RMSNorm(d) if kind == "rmsnorm" else nn.LayerNorm(d)


class SigmaReparamLinear(nn.Module):
    """Bias-free linear layer with W_hat = gamma / sigma(W) * W (Zhai et al. 2023).

    sigma is estimated by one power iteration per training forward; gamma is
    learned and starts at sigma(W), so the layer is unchanged at init.

    Precision: the power iteration, sigma and W_hat are computed in float32 (float64 stays
    float64) with autocast disabled, as the reference implementation does; only the matmul
    that uses W_hat runs under the caller's autocast. Under bf16 autocast they would be
    rounded to bf16: 0.2-0.7 % error on sigma, u, v and W_hat, measured (issue 46).
    """

    u: Tensor
    v: Tensor

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.gamma = nn.Parameter(torch.ones(()))
        self.register_buffer("u", F.normalize(torch.randn(out_features), dim=0))
        self.register_buffer("v", F.normalize(torch.randn(in_features), dim=0))

    @torch.no_grad()
    def reset_gamma(self) -> None:
        """Start u, v at the exact top singular pair and gamma at sigma(W) (call after init).

        Then W_hat = W at init exactly, and the power iteration starts converged.
        """
        with no_autocast(self.weight):
            w = float32_or_wider(self.weight)
            u, s, vh = torch.linalg.svd(w, full_matrices=False)
            self.u.copy_(u[:, 0])
            self.v.copy_(vh[0])
            self.gamma.copy_(s[0])

    @torch.no_grad()
    def _power_iteration(self) -> None:
        with no_autocast(self.weight):
            w = float32_or_wider(self.weight)
            v = F.normalize(w.t() @ self.u.to(w.dtype), dim=0)
            self.u.copy_(F.normalize(w @ v, dim=0))
            self.v.copy_(v)

    def sigma(self) -> Tensor:
        """sigma(W) = u^T W v: differentiable in W (u and v fixed), float32 or wider, () ."""
        with no_autocast(self.weight):
            w = float32_or_wider(self.weight)
            return self.u.to(w.dtype) @ w @ self.v.to(w.dtype)

    def effective_weight(self) -> Tensor:
        """W_hat = gamma / sigma(W) * W, float32 or wider, computed outside autocast."""
        with no_autocast(self.weight):
            w = float32_or_wider(self.weight)
            return self.gamma.to(w.dtype) / self.sigma() * w

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            self._power_iteration()
        y: Tensor = F.linear(x, self.effective_weight())
        return y


def _linear(d_in: int, d_out: int, sigma_reparam: bool) -> nn.Module:
    return SigmaReparamLinear(d_in, d_out) if sigma_reparam else nn.Linear(d_in, d_out, bias=False)


def _weight(layer: nn.Module) -> Tensor:
    if isinstance(layer, SigmaReparamLinear):
        return layer.effective_weight()
    assert isinstance(layer, nn.Linear)
    return layer.weight


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; causal unless `ModelConfig.causal` is false."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        every = cfg.sigma_reparam == "all"
        sigma = cfg.qk_norm == "sigma_reparam" or every
        self.q_proj = _linear(cfg.d_model, cfg.d_model, sigma)
        self.k_proj = _linear(cfg.d_model, cfg.d_model, sigma)
        self.v_proj = _linear(cfg.d_model, cfg.d_model, every)
        self.out_proj = _linear(cfg.d_model, cfg.d_model, every)
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()
        if cfg.qk_norm in ("layernorm", "rmsnorm"):
            self.q_norm = make_norm(cfg.qk_norm, cfg.d_head)
            self.k_norm = make_norm(cfg.qk_norm, cfg.d_head)
        self.rotary = cfg.position == "rotary"
        self.scale = 1.0 / (math.sqrt(cfg.d_head) * cfg.attn_temperature)
        self.dropout = cfg.dropout
        self.causal = cfg.causal

    def qk_weights(self) -> tuple[Tensor, Tensor]:
        """Effective query and key weights per head: two (H, d_h, D) tensors."""
        d = self.n_heads * self.d_head
        w_q = _weight(self.q_proj).view(self.n_heads, self.d_head, d)
        w_k = _weight(self.k_proj).view(self.n_heads, self.d_head, d)
        return w_q, w_k

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, d_h)
        k = self.k_proj(x).view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, d_h)
        v = self.v_proj(x).view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, d_h)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:  # after the QK norm, per head
            cos, sin = rotary_tables(t, self.d_head, x.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def _merge(self, y: Tensor) -> Tensor:
        b, h, t, dh = y.shape
        out: Tensor = self.out_proj(y.transpose(1, 2).reshape(b, t, h * dh))  # (B, T, D)
        return out

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(x)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, dropout_p=p, scale=self.scale
        )  # (B, H, T, d_h)
        return self._merge(y)

    def probe(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Attention computed explicitly: output (B, T, D), probabilities (B, H, T, T), and
        the q, k (B, H, T, d_h) the logits were made from (for the logit probe).

        The softmax runs in float32 or wider (float64 stays float64); without the causal
        mask every row spans all T keys."""
        q, k, v = self._heads(x)
        t = x.shape[1]
        logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, H, T, T)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        attn = logits.softmax(dim=-1)  # (B, H, T, T)
        return self._merge(attn.to(v.dtype) @ v), attn, q, k


class MLP(nn.Module):
    """proj(gelu(fc x)), or SwiGLU: fc makes gate and up (d_ff each), proj(silu(gate) * up)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp_type == "swiglu"
        every = cfg.sigma_reparam == "all"
        self.fc = _linear(cfg.d_model, cfg.d_ff * (2 if self.swiglu else 1), every)
        self.proj = _linear(cfg.d_ff, cfg.d_model, every)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)  # (B, T, d_ff) or (B, T, 2 d_ff)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        y: Tensor = self.drop(self.proj(h))  # (B, T, D)
        return y


class Block(nn.Module):
    """One layer: attention then (optionally) an MLP, with the configured norm and skips."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg) if cfg.mlp else None
        use_norm = cfg.norm != "none"
        self.ln1: nn.Module = make_norm(cfg.norm_type, cfg.d_model) if use_norm else nn.Identity()
        self.ln2: nn.Module = make_norm(cfg.norm_type, cfg.d_model) if use_norm else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)

    def _residual(self, x: Tensor, out: Tensor, ln: nn.Module, skip: bool) -> Tensor:
        """Combine a sublayer's input and output: skip or not, post-norm or not."""
        y = x + out if skip else out
        return ln(y) if self.cfg.norm == "post" else y

    def _run(self, x: Tensor, probe: bool) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """The block's output and, when probing, its (attention, q, k)."""
        pre = self.cfg.norm == "pre"
        probed: tuple[Tensor, Tensor, Tensor] | None = None
        a_in = self.ln1(x) if pre else x
        if probe:
            a_out, attn_map, q, k = self.attn.probe(a_in)
            probed = (attn_map, q, k)
        else:
            a_out = self.attn(a_in)
        x = self._residual(x, self.drop(a_out), self.ln1, self.cfg.skip)
        if self.mlp is not None:
            m_out = self.mlp(self.ln2(x) if pre else x)
            x = self._residual(x, m_out, self.ln2, self.cfg.mlp_residual)
        return x, probed

    def forward(self, x: Tensor) -> Tensor:
        return self._run(x, probe=False)[0]


class GPT(QKModel):
    """The built-in model; implements the engine's protocol (workers/models/base.py)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.seq_len = cfg, vocab_size, seq_len
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        # rotary positions live in the attention: no position embedding then
        self.pos_emb = nn.Embedding(seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        pre = cfg.norm == "pre"
        self.ln_f: nn.Module = make_norm(cfg.norm_type, cfg.d_model) if pre else nn.Identity()
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying, as in nanoGPT
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT init (normal, std 0.02), then the query/key and MLP scales of the config.

        The MLP weights take `mlp_init_std` in the same draw as everything else (same order,
        same number of draws), so at the default 0.02 the model is bit-identical to the one
        built before the knob existed.
        """
        mlp_layers = {
            id(layer)
            for block in self.blocks
            if isinstance(block, Block) and block.mlp is not None
            for layer in (block.mlp.fc, block.mlp.proj)
        }
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | SigmaReparamLinear):
                std = self.cfg.mlp_init_std if id(module) in mlp_layers else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.q_proj, block.attn.k_proj):
                assert isinstance(proj, nn.Linear | SigmaReparamLinear)
                nn.init.normal_(proj.weight, mean=0.0, std=self.cfg.qk_init_std)
        if self.cfg.init_scheme == "token_scale":
            self._rescale_for_token_scale()
        if self.cfg.qkv_init == "fairseq":  # drawn last: every other weight as before
            for block in self.blocks:
                assert isinstance(block, Block)
                a = block.attn
                for proj in (a.q_proj, a.k_proj, a.v_proj, a.out_proj):
                    assert isinstance(proj, nn.Linear | SigmaReparamLinear)
                    gain = 1.0 if proj is a.out_proj else 2**-0.5
                    nn.init.xavier_uniform_(proj.weight, gain=gain)
        if self.cfg.embed_scale == "sqrt_d":  # fairseq: std 1/sqrt(D), no extra draw
            with torch.no_grad():
                self.tok_emb.weight.mul_(self.cfg.d_model**-0.5 / 0.02)
        for module in self.modules():  # draws nothing: the draws above are as they were
            if isinstance(module, SigmaReparamLinear):  # gamma = sigma(W) of the final W
                module.reset_gamma()

    @torch.no_grad()
    def _rescale_for_token_scale(self) -> None:
        """`init_scheme: token_scale` (workers/config_sections.py): rescale the GPT draws, drawing
        nothing more, so the default init stays bit-identical and the RNG stream unchanged."""
        for emb in (self.tok_emb, self.pos_emb):  # the tied head scales with tok_emb
            if emb is not None:  # no learned positions under rotary
                emb.weight.mul_(math.sqrt(0.5) / 0.02)
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.v_proj, block.attn.out_proj):
                assert isinstance(proj, nn.Linear | SigmaReparamLinear)
                proj.weight.mul_(1.0 / (math.sqrt(self.cfg.d_model) * 0.02))

    @property
    def causal(self) -> bool:
        return self.cfg.causal

    def qk_weights(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the effective (H, d_h, D) query and key weights."""
        return [block.attn.qk_weights() for block in self.blocks if isinstance(block, Block)]

    def qk_input_gains(self) -> list[Tensor | None]:
        """Per layer, the gain g (D,) of the norm the attention reads under Pre-LN (its
        `ln1`, LayerNorm or RMSNorm), else None: under Post-LN or no norm nothing stands
        between the block's input and its attention. docs/metrics.md section 3."""
        gains: list[Tensor | None] = []
        for block in self.blocks:
            assert isinstance(block, Block)
            weight = getattr(block.ln1, "weight", None) if self.cfg.norm == "pre" else None
            gains.append(weight if isinstance(weight, Tensor) else None)
        return gains

    def _embed(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        x: Tensor = self.tok_emb(idx)  # (B, T, D)
        if self.cfg.embed_scale == "sqrt_d":  # fairseq's embed_scale, before the positions
            x = x * math.sqrt(self.cfg.d_model)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        out: Tensor = self.drop(x)
        return out

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, V) and, with targets (-100 = ignored), the mean cross-entropy."""
        x = self._embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
            loss = F.cross_entropy(
                wide.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100
            )
        return logits, loss

    @torch.no_grad()
    def probe(self, idx: Tensor) -> ProbeOutput:
        """Forward with explicit attention; returns attention maps and hidden states."""
        x = self._embed(idx)
        hidden, attn, qk = [x], [], []
        scale = 0.0
        for block in self.blocks:
            assert isinstance(block, Block)
            x, probed = block._run(x, probe=True)
            assert probed is not None
            hidden.append(x)
            attn.append(probed[0])
            qk.append((probed[1], probed[2]))
            scale = block.attn.scale
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return ProbeOutput(logits=logits, attn=attn, hidden=hidden, qk=qk, scale=scale)
