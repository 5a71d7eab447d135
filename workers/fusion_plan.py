"""Which trials can train together as one fused model, and in which groups; torch-free.

The runner groups the trials it asks Optuna for without loading torch (the trial processes
do); `workers.fused` trains the groups and re-exports these names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from workers.config import TrialConfig

__all__ = [
    "AUTO_FUSE_MAX_FLOPS",
    "PER_MEMBER_FIELDS",
    "LM_VALID_BATCHES",
    "FusionError",
    "MemoryEstimate",
    "auto_fuse",
    "check_fusable",
    "estimated_params",
    "float_bytes",
    "fusion_key",
    "group_by_key",
    "member_bytes",
    "memory_estimate",
    "slots_that_fit",
    "step_flops",
    "vocab_bound",
]

# Fields that may differ between members; everything else must be equal (the fusion key).
PER_MEMBER_FIELDS: dict[str, tuple[str, ...]] = {
    "": (
        "seed",
        "regularizer",
        "checkpoint",
        "entropy_collapse_threshold",
        "rank_collapse_threshold",
        "plateau_window",
        "plateau_rel_tol",
        "trapped_rel_gap",
        "z_loss_coef",
    ),
    "optim": ("lr", "weight_decay", "weight_decay_mode", "beta1", "beta2", "grad_clip"),
    "model": ("qk_init_std", "mlp_init_std", "init_scheme", "attn_temperature"),
}


class FusionError(ValueError):
    """A config that cannot be trained as a fused member (names the field)."""


def check_fusable(config: TrialConfig) -> None:
    """Refuse what the fused model cannot reproduce exactly."""
    if config.model.kind != "builtin":
        raise FusionError(
            f"model.kind: {config.model.kind} trains alone: only the built-in model fuses "
            "(fusing Hugging Face models through torch.func is not implemented yet); fuse: 1"
        )
    if config.model.dropout > 0.0:
        raise FusionError(
            "model.dropout: fused trials draw no randomness in the forward, so dropout > 0 "
            "cannot match the trial run alone; use fuse: 1"
        )


def fusion_key(config: TrialConfig) -> str:
    """The fields that shape the fused program (architecture, data shapes, loop): JSON."""
    data = config.model_dump(mode="json", by_alias=True)
    for section, names in PER_MEMBER_FIELDS.items():
        node = data[section] if section else data
        for name in names:
            node.pop(name, None)
    return json.dumps(data, sort_keys=True)


def group_by_key(configs: Sequence[TrialConfig], max_size: int) -> list[list[int]]:
    """Indices of `configs` in groups of equal `fusion_key`, at most `max_size` each.

    Groups keep the order of first appearance; configs that cannot be fused get a group of
    their own.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    open_groups: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for i, cfg in enumerate(configs):
        try:
            check_fusable(cfg)
        except FusionError:
            groups.append([i])
            continue
        key = fusion_key(cfg)
        group = open_groups.get(key)
        if group is None or len(group) >= max_size:
            group = open_groups[key] = []
            groups.append(group)
        group.append(i)
    return groups


def estimated_params(config: TrialConfig, vocab_size: int) -> int:
    """Parameters of the trial's GPT, counted from its shapes (an upper bound: every norm
    and QK-norm weight and bias counted, the head tied to the token embedding)."""
    z, t = config.model.sizes(), config.task.seq_len
    d, f, layers = z.d_model, z.d_ff, z.n_layers
    mlp = z.mlp_matrices * d * f
    per_layer = 4 * d * d + mlp + 4 * d + 4 * (d // z.n_heads)
    return vocab_size * d + t * d + layers * per_layer + 2 * d


def member_bytes(config: TrialConfig, vocab_size: int) -> int:
    """An estimate of the accelerator memory one fused member needs, in bytes.

    Parameters four times over in float32 (weights, gradients, AdamW's two moments), the
    activations a training step keeps for backward at the config's batch and sequence length
    (per layer: the residual stream, q/k/v, attention output, the MLP's hidden layer and the
    norms, about 12 d_model + 2 d_ff floats per token, plus the attention probabilities when
    the attention kernel materialises them), and the logits with their gradient. It errs
    high on purpose: a slot count from it should fit, and an out-of-memory still shrinks the
    worker (workers/slot_worker.py).
    """
    z, b, t = config.model.sizes(), config.batch_size, config.task.seq_len
    d, f, h, layers = z.d_model, z.d_ff, z.n_heads, z.n_layers
    params = estimated_params(config, vocab_size)
    per_layer = b * t * (12 * d + 2 * f) + b * h * t * t
    logits = 3 * b * t * vocab_size
    return 4 * (4 * params + layers * per_layer + logits)


# Host bytes per validation token a synthetic task holds at its peak: x and y as int64 (16 B)
# and the copies its generation makes on the way (sort and copy measured 36 B, 2026-12).
VALID_BYTES_PER_TOKEN = 40
# associative_recall also ranks n_symbols random keys per example (float32 scores, int64
# argsort: 16 B per example and symbol measured; 24 with the allocator's slack).
RECALL_BYTES_PER_SYMBOL = 24
# An lm task keeps at most this many validation batches of windows (tasks.MAX_VALID_BATCHES).
LM_VALID_BATCHES = 64


@dataclass(frozen=True)
class MemoryEstimate:
    """What one member of a trial holds at its peak, in bytes, by part (each errs high).

    `parameters`: weights, gradients and AdamW's two moments (4 bytes a number, 8 in
    float64: `float_bytes`, as every float part); `activations`: what a
    training step keeps for backward (per layer the residual stream, q/k/v, the MLP's hidden
    layer, the norms and the batch x heads x seq_len^2 attention scores and probabilities,
    which a CPU or unfused attention kernel materialises); `logits`:
    the training step's logits, softmax and gradient (batch x seq_len x vocabulary, 3x);
    `probe`: the metrics probe's attention maps of every layer (probe_batch_size x heads x
    seq_len^2 each) and its logits; `validation`: the validation set in host memory
    (synthetic tasks: n_valid x seq_len, generated at once; lm: at most LM_VALID_BATCHES
    batches of windows; the corpus itself is shared by the members of a process and not
    counted).
    """

    parameters: int
    activations: int
    logits: int
    probe: int
    validation: int

    @property
    def total(self) -> int:
        return self.parameters + self.activations + self.logits + self.probe + self.validation

    def largest(self) -> str:
        """The name of the largest part."""
        parts = {
            "parameters": self.parameters,
            "activations": self.activations,
            "logits": self.logits,
            "probe": self.probe,
            "validation": self.validation,
        }
        return max(parts, key=lambda k: parts[k])


def float_bytes(config: TrialConfig) -> int:
    """Bytes of one number of the weights, the optimizer state and the activations: 8 in
    float64, else 4 (float32; bfloat16 trains under autocast with float32 master weights and
    optimizer state, so 4 errs high there). Token ids (the validation set) are not floats."""
    return 8 if config.dtype == "float64" else 4


def memory_estimate(config: TrialConfig, vocab_size: int | None = None) -> MemoryEstimate:
    """The peak memory of one member of `config`, by part (`vocab_bound` unless given)."""
    z, t, b = config.model.sizes(), config.task, config.batch_size
    vocab = vocab_bound(config) if vocab_size is None else vocab_size
    d, f, h, layers, seq = z.d_model, z.d_ff, z.n_heads, z.n_layers, t.seq_len
    w = float_bytes(config)
    per_layer = b * seq * (12 * d + 2 * f) + 2 * b * h * seq * seq  # scores and probabilities
    p = config.probe_batch_size
    if t.kind == "lm":
        validation = 16 * LM_VALID_BATCHES * b * seq
    else:
        validation = VALID_BYTES_PER_TOKEN * t.n_valid * seq
        if t.kind == "associative_recall":
            validation += RECALL_BYTES_PER_SYMBOL * t.n_valid * t.n_symbols
    return MemoryEstimate(
        parameters=4 * w * estimated_params(config, vocab),
        activations=w * layers * per_layer,
        logits=w * 3 * b * seq * vocab,
        probe=w * ((layers + 2) * p * h * seq * seq + p * seq * vocab),
        validation=validation,
    )


def slots_that_fit(config: TrialConfig, vocab_size: int, free_bytes: int, wanted: int) -> int:
    """How many of `wanted` members fit in `free_bytes` (80 % of it, never fewer than one)."""
    return max(1, min(wanted, int(0.8 * free_bytes) // max(1, member_bytes(config, vocab_size))))


AUTO_FUSE_MAX_FLOPS = 0.25e9
"""Below this many training FLOPs per step fusion pays on a CPU. A CPU study's workers get one
core and one torch thread each and already fill the cores, so fusion only saves per-operation
overhead: 4 fused members trained 1.11-1.20x the trials/s of one plain trial at 0.035-0.21
GFLOP/step, 0.92x at 0.34 and 0.80-0.81x at 0.45-0.67 (`python -m bench.archive.fuse_threshold`,
single thread, 2026-11-25; bench/README.md). Through the service the small grids gain more
(1.5-1.7x for the entropy-collapse grid at 0.035 GFLOP), as per-trial costs are shared too."""
AUTO_FUSE_CPU = 4
AUTO_FUSE_GPU = 8


def vocab_bound(config: TrialConfig) -> int:
    """The task's vocabulary, or an upper bound of it, without building the task: for
    language modelling the size the config fixes (`TaskConfig.fixed_vocab_size`) or the cap
    (word and char), 2 x symbols + 2 for the synthetic tasks (associative recall; sort and
    copy use symbols + 2)."""
    t = config.task
    if t.kind != "lm":
        return 2 * t.n_symbols + 2
    fixed = t.fixed_vocab_size
    return t.vocab_cap if fixed is None else fixed


def step_flops(config: TrialConfig, vocab_size: int | None = None) -> float:
    """Training FLOPs of one step: 6 x weights x tokens for the blocks and the tied head
    (vocabulary x d_model; `vocab_bound` unless given), plus the attention scores (12 x
    layers x d_model x seq_len per token). The embedding lookup costs no matmul."""
    m, tokens = config.model.sizes(), config.batch_size * config.task.seq_len
    vocab = vocab_bound(config) if vocab_size is None else vocab_size
    mlp = m.mlp_matrices * m.d_model * m.d_ff
    weights = m.n_layers * (4 * m.d_model**2 + mlp)
    weights += vocab * m.d_model
    return float(6 * weights * tokens + 12 * m.n_layers * m.d_model * config.task.seq_len * tokens)


def auto_fuse(config: TrialConfig, gpus: float) -> int:
    """The slots per worker `fuse: auto` gives: 1 for a config the fused model refuses; on a
    GPU, AUTO_FUSE_GPU (the worker lowers it to what its memory estimate says fits); on CPU,
    AUTO_FUSE_CPU for small steps (AUTO_FUSE_MAX_FLOPS), else 1."""
    try:
        check_fusable(config)
    except FusionError:
        return 1
    if gpus > 0:
        return AUTO_FUSE_GPU
    return AUTO_FUSE_CPU if step_flops(config) < AUTO_FUSE_MAX_FLOPS else 1
