"""M copies of `workers.model.GPT` trained as one model: every weight has a leading member axis.

Horizontal fusion (HFTA, Wang et al. 2021): trials that share an architecture run their
forward and backward passes as batched matrix products over a member axis, so many small
models fill an accelerator that one of them would leave idle. Members never mix: every
operation is per member (batched matmuls, per-member LayerNorm, attention folded into the
batch axis), so the gradient of the summed loss with respect to member m's weights is exactly
the gradient of member m's own loss, and one member's NaN cannot reach another.

The weights are `GPT.named_parameters()` stacked on dim 0 under the same names, so a member
is loaded from, and written back into, an ordinary `GPT` (the probes, the validation loss and
the checkpoints of `workers.trial` then apply unchanged). Per-member knobs that are not
shapes (the attention temperature, via the logit scale) are (M,) tensors.

Explicit batched matmuls were measured against `torch.func.vmap(functional_call(GPT))` on
CPU (bench/README.md, "fused model: bmm vs vmap"); the batched form is kept.

The model options (`ModelConfig`: RMSNorm, rotary positions, SwiGLU, sigma-reparam of the
query/key projections or of every linear layer) are computed here exactly as `workers.model`
computes them, per member; sigma-reparam's power-iteration vectors (`u`, `v`, buffers of the
GPT) are stacked like the weights and advanced once per training forward, as the GPT's
training forward does. z-loss is `losses`' second output.

Not supported (refused by `workers.fused.check_fusable`): dropout (the fused model draws no
randomness, so it cannot match a trial that does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.config import ModelConfig, RegularizerKind
from workers.model import GPT, apply_rotary, float32_or_wider, no_autocast, rotary_tables
from workers.regularizers import locater_penalty, spectral_variance_penalty, z_loss

__all__ = ["FusedGPT"]


class FusedGPT:
    """The stacked weights of M GPTs and their batched training forward."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, Tensor],
        temperatures: Tensor,
        buffers: dict[str, Tensor] | None = None,
    ):
        self.cfg = cfg
        self.params = params  # name -> (M, *shape), leaf tensors with requires_grad
        # name -> (M, *shape): sigma-reparam's power-iteration vectors (`<layer>.u`, `.v`)
        self.buffers = buffers or {}
        # the linear layers that are sigma-reparametrised (they have a learned gamma)
        self.sigma_layers = [n[: -len(".gamma")] for n in params if n.endswith(".gamma")]
        self.n_members = temperatures.shape[0]
        # Each member's logit scale 1 / (sqrt(d_h) * temperature): (M,), in float64 like the
        # Python float `CausalSelfAttention.scale`, rounded once to the activations' dtype
        self.scale = 1.0 / (math.sqrt(cfg.d_head) * temperatures.to(torch.float64))

    @classmethod
    def from_models(cls, models: Sequence[GPT], device: torch.device) -> FusedGPT:
        """Stack the members' weights (tied head = token embedding, as in GPT)."""
        cfg = models[0].cfg
        names = [n for n, _ in models[0].named_parameters()]
        per_member = [dict(m.named_parameters()) for m in models]
        params = {
            n: torch.stack([p[n].detach() for p in per_member]).to(device).requires_grad_(True)
            for n in names
        }
        per_member_bufs = [dict(m.named_buffers()) for m in models]
        buffers = {
            n: torch.stack([b[n].detach() for b in per_member_bufs]).to(device)
            for n, _ in models[0].named_buffers()
        }
        temps = torch.tensor(
            [m.cfg.attn_temperature for m in models], dtype=torch.float64, device=device
        )
        return cls(cfg, params, temps, buffers)

    @torch.no_grad()
    def write_member(self, m: int, model: GPT) -> None:
        """Copy member m's weights (and power-iteration vectors) into an ordinary GPT of the
        same config."""
        for name, p in model.named_parameters():
            p.copy_(self.params[name][m])
        for name, b in model.named_buffers():
            b.copy_(self.buffers[name][m])

    @torch.no_grad()
    def read_member(self, m: int, model: GPT) -> None:
        """Load member m's weights (and power-iteration vectors) from an ordinary GPT
        (checkpoint resume)."""
        for name, p in model.named_parameters():
            self.params[name][m].copy_(p)
        for name, b in model.named_buffers():
            self.buffers[name][m].copy_(b)

    def parameters(self) -> list[Tensor]:
        return list(self.params.values())

    # ---- the batched forward ------------------------------------------------------------

    @staticmethod
    def _linear(x: Tensor, w: Tensor) -> Tensor:
        """Per-member x @ w^T: x (M, B, T, in), w (M, out, in) -> (M, B, T, out)."""
        m, b, t, d = x.shape
        y = torch.bmm(x.reshape(m, b * t, d), w.transpose(1, 2))  # (M, B*T, out)
        return y.view(m, b, t, w.shape[1])

    def _layer_norm(self, x: Tensor, prefix: str, kind: str = "layernorm") -> Tensor:
        """Per-member affine LayerNorm (or RMSNorm: a scale, no bias) over the last axis;
        x (M, ..., D)."""
        w = self.params[prefix + ".weight"]
        shape = (w.shape[0],) + (1,) * (x.dim() - 2) + (w.shape[1],)
        if kind == "rmsnorm":  # torch.nn.RMSNorm's default eps (None: the dtype's eps)
            return F.rms_norm(x, (x.shape[-1],)) * w.view(shape)
        b = self.params[prefix + ".bias"]
        y = F.layer_norm(x, (x.shape[-1],))
        return y * w.view(shape) + b.view(shape)

    def _block_norm(self, x: Tensor, prefix: str) -> Tensor:
        """A block's (or the final) norm, of the config's `norm_type`."""
        return self._layer_norm(x, prefix, self.cfg.norm_type)

    @torch.no_grad()
    def _power_iteration(self) -> None:
        """One power-iteration step of every sigma-reparam layer, per member (as
        `SigmaReparamLinear` does in each training forward: float32 or wider, autocast off)."""
        for layer in self.sigma_layers:
            w = self.params[layer + ".weight"]
            with no_autocast(w):
                w = float32_or_wider(w)  # (M, out, in)
                u, v = self.buffers[layer + ".u"], self.buffers[layer + ".v"]
                v_new = torch.bmm(w.transpose(1, 2), u.to(w.dtype).unsqueeze(-1)).squeeze(-1)
                v_new = F.normalize(v_new, dim=1)
                u.copy_(F.normalize(torch.bmm(w, v_new.unsqueeze(-1)).squeeze(-1), dim=1))
                v.copy_(v_new)

    def sigma(self, layer: str) -> Tensor:
        """A sigma-reparam layer's sigma(W) = u^T W v per member (M,): differentiable in W,
        float32 or wider, computed outside autocast (as `SigmaReparamLinear.sigma`)."""
        w = self.params[layer + ".weight"]
        with no_autocast(w):
            w = float32_or_wider(w)
            u, v = self.buffers[layer + ".u"].to(w.dtype), self.buffers[layer + ".v"].to(w.dtype)
            return (torch.bmm(u.unsqueeze(1), w).squeeze(1) * v).sum(dim=-1)

    def weight(self, layer: str) -> Tensor:
        """A linear layer's effective (M, out, in) weight: gamma / sigma(W) * W for a
        sigma-reparam layer (float32 or wider, outside autocast, as
        `SigmaReparamLinear.effective_weight`), W otherwise."""
        w = self.params[layer + ".weight"]
        if layer + ".gamma" not in self.params:
            return w
        with no_autocast(w):
            w = float32_or_wider(w)
            gamma = self.params[layer + ".gamma"].to(w.dtype)  # (M,)
            return (gamma / self.sigma(layer)).view(-1, 1, 1) * w

    def _attention(self, x: Tensor, i: int) -> Tensor:
        """Self-attention of block i (causal unless `cfg.causal` is false); x (M, B, T, D)."""
        cfg, p = self.cfg, f"blocks.{i}.attn"
        m, b, t, d = x.shape
        h, dh = cfg.n_heads, cfg.d_head

        def heads(name: str) -> Tensor:
            y = self._linear(x, self.weight(f"{p}.{name}"))  # (M, B, T, D)
            return y.view(m, b, t, h, dh).transpose(2, 3)  # (M, B, H, T, d_h)

        q, k, v = heads("q_proj"), heads("k_proj"), heads("v_proj")
        if cfg.qk_norm in ("layernorm", "rmsnorm"):
            q = self._layer_norm(q, f"{p}.q_norm", cfg.qk_norm)
            k = self._layer_norm(k, f"{p}.k_norm", cfg.qk_norm)
        if cfg.position == "rotary":  # after the QK norm, per head, as GPT does
            cos, sin = rotary_tables(t, dh, x.device, q.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q = q * self.scale.to(q.dtype).view(m, 1, 1, 1, 1)  # per-member temperature
        y = F.scaled_dot_product_attention(
            q.reshape(m * b, h, t, dh),
            k.reshape(m * b, h, t, dh),
            v.reshape(m * b, h, t, dh),
            is_causal=cfg.causal,
            scale=1.0,
        )  # (M*B, H, T, d_h)
        y = y.view(m, b, h, t, dh).transpose(2, 3).reshape(m, b, t, d)
        return self._linear(y, self.weight(f"{p}.out_proj"))

    def _mlp(self, x: Tensor, i: int) -> Tensor:
        """Block i's MLP (GELU or SwiGLU); x (M, B, T, D)."""
        hid = self._linear(x, self.weight(f"blocks.{i}.mlp.fc"))
        if self.cfg.mlp_type == "swiglu":
            gate, up = hid.chunk(2, dim=-1)
            hid = F.silu(gate) * up
        else:
            hid = F.gelu(hid)
        return self._linear(hid, self.weight(f"blocks.{i}.mlp.proj"))

    def _residual(self, x: Tensor, out: Tensor, ln: str, skip: bool) -> Tensor:
        y = x + out if skip else out
        return self._block_norm(y, ln) if self.cfg.norm == "post" else y

    @property
    def _mlp_skip(self) -> bool:
        """The MLP's own residual: `ModelConfig.mlp_residual` where it exists, else `skip`."""
        return bool(getattr(self.cfg, "mlp_residual", self.cfg.skip))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Per-member mean cross-entropy (M,) of (M, B, T) inputs and targets (-100 ignored)."""
        return self.losses(idx, targets)[0]

    def losses(
        self, idx: Tensor, targets: Tensor, z_members: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Per-member mean cross-entropy (M,) and, for the members `z_members` (an index
        tensor) only, their z-loss term mean_t (log Z_t)^2 (len(z_members),), without its
        coefficient (`workers.regularizers.z_loss`, float32 outside autocast)."""
        cfg, p = self.cfg, self.params
        m, b, t = idx.shape
        if self.sigma_layers:
            self._power_iteration()
        tok = p["tok_emb.weight"]  # (M, V, D)
        members = torch.arange(m, device=idx.device).view(m, 1, 1)
        x = tok[members, idx]  # (M, B, T, D)
        if cfg.embed_scale == "sqrt_d":  # as GPT._embed: scaled before the positions
            x = x * math.sqrt(cfg.d_model)
        if cfg.position == "learned":
            x = x + p["pos_emb.weight"][:, :t].unsqueeze(1)
        pre = cfg.norm == "pre"
        for i in range(cfg.n_layers):
            blk = f"blocks.{i}"
            a_in = self._block_norm(x, f"{blk}.ln1") if pre else x
            x = self._residual(x, self._attention(a_in, i), f"{blk}.ln1", cfg.skip)
            if cfg.mlp:
                m_in = self._block_norm(x, f"{blk}.ln2") if pre else x
                x = self._residual(x, self._mlp(m_in, i), f"{blk}.ln2", self._mlp_skip)
        if pre:
            x = self._block_norm(x, "ln_f")
        logits = self._linear(x, tok)  # (M, B, T, V), head tied to the token embedding
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
        nll = F.cross_entropy(
            wide.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=-100,
            reduction="none",
        ).view(m, b * t)
        counted = (targets.view(m, b * t) != -100).sum(dim=1)  # (M,)
        ce = nll.sum(dim=1) / counted  # mean over counted targets, as F.cross_entropy does
        z = None if z_members is None else z_loss(logits[z_members], targets[z_members])
        return ce, z

    # ---- regularizers ---------------------------------------------------------------------

    def qk_weights(self) -> tuple[Tensor, Tensor]:
        """Query and key weights of every layer and head: two (M, L, H, d_h, D) tensors."""
        cfg = self.cfg
        shape = (self.n_members, cfg.n_heads, cfg.d_head, cfg.d_model)
        w_q = [self.weight(f"blocks.{i}.attn.q_proj").view(shape) for i in range(cfg.n_layers)]
        w_k = [self.weight(f"blocks.{i}.attn.k_proj").view(shape) for i in range(cfg.n_layers)]
        return torch.stack(w_q, dim=1), torch.stack(w_k, dim=1)

    def penalties(self, kinds: Sequence[RegularizerKind], target_means: Sequence[float]) -> Tensor:
        """Each member's own regularizer, mean over layers and heads: (M,); 0 for kind none.

        Computed only on the members that use each penalty (an index subset): a member of
        kind none gets a constant 0 with no graph through its weights, so a penalty that would
        overflow for it cannot reach its loss or its gradient. In float32 (or wider) with
        autocast disabled, as `workers.regularizers` computes each penalty: under bf16
        autocast `||W_sym||_F^2 / D - mean^2` cancels and can come out negative.
        """
        with torch.autocast(self.params["tok_emb.weight"].device.type, enabled=False):
            w_q, w_k = self.qk_weights()
            dtype = torch.promote_types(w_q.dtype, torch.float32)
            w_q, w_k = w_q.to(dtype), w_k.to(dtype)
            out = torch.zeros(self.n_members, device=w_q.device, dtype=dtype)
            groups: dict[tuple[str, float], list[int]] = {}
            for m, (k, t) in enumerate(zip(kinds, target_means, strict=True)):
                if k != "none":
                    groups.setdefault((k, t if k == "locater" else 0.0), []).append(m)
            for (kind, target), idx in sorted(groups.items()):
                sel = torch.tensor(idx, device=w_q.device)
                if kind == "spectral_variance":
                    val = spectral_variance_penalty(w_q[sel], w_k[sel])
                else:  # members sharing a target mean: one batched call of the same function
                    val = locater_penalty(w_q[sel], w_k[sel], target)
                out = out.index_copy(0, sel, val.mean(dim=(1, 2)).to(dtype))
        return out
