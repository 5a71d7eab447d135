"""The configuration and result types of one trial, importable without torch.

The service (spec validation, the API, the runner) needs these types but never trains;
keeping them here, free of torch, saves every service process torch's import time
(about a second and a few hundred MB). `workers.trial`, `workers.model`, `workers.tasks`
and `workers.regularizers` re-export them from where they used to live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Self

import pydantic
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

__all__ = [
    "BLOCK_PRESETS",
    "CAUSAL_ONLY_TASKS",
    "BlockPreset",
    "CheckpointConfig",
    "MetricPoint",
    "ModelConfig",
    "OptimConfig",
    "RegularizerConfig",
    "RegularizerKind",
    "TaskConfig",
    "TrialConfig",
    "TrialStatus",
    "TrialSummary",
]

RegularizerKind = Literal["none", "spectral_variance", "locater"]

# Tasks whose targets are their own inputs at later positions (workers/tasks.py): lm predicts
# y[t] = x[t + 1] at every position; sort and copy predict each answer symbol b_i from the
# position before it, with b_i itself in the input. Without the causal mask every query would
# see the token it must predict, so `model.causal: false` is refused for them
# (`TrialConfig._mask_hides_the_targets`). associative_recall is not here: its one target is
# at the last position, with no later input, and the value it recalls sits earlier in the
# sequence, where the causal model sees it too.
CAUSAL_ONLY_TASKS: dict[str, str] = {
    "lm": "its targets are its inputs shifted by one (y[t] = x[t + 1])",
    "sort": "each answer symbol is the next input token (y[t] = x[t + 1] after the separator)",
    "copy": "each answer symbol is the next input token (y[t] = x[t + 1] after the separator)",
}


class TaskConfig(pydantic.BaseModel):
    """Which task a trial trains on and how its data is shaped.

    Fields that do not apply to the chosen ``kind`` are ignored (e.g. ``n_pairs`` for ``lm``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["lm", "associative_recall", "sort", "copy"] = "associative_recall"
    seq_len: int = Field(
        default=64, ge=4, le=4096, description="Tokens per example fed to the model."
    )
    # lm
    data_dir: str | None = Field(
        default=None,
        description="Directory with <train_split>.txt and <valid_split>.txt (lm only).",
    )
    train_split: str = Field(default="train", description="File stem of the training split.")
    valid_split: str = Field(default="valid", description="File stem of the validation split.")
    tokenizer: Literal["word", "char"] = "word"
    vocab_cap: int = Field(
        default=10000,
        ge=16,
        le=1_000_000,
        description="Most frequent tokens kept; rest map to <unk>.",
    )
    max_train_tokens: int | None = Field(
        default=None, ge=1000, description="Optional truncation of the training split (fast tests)."
    )
    # synthetic
    n_symbols: int = Field(
        default=16, ge=2, le=4096, description="Alphabet size of synthetic tasks."
    )
    n_pairs: int = Field(
        default=8, ge=1, le=512, description="associative_recall: pairs per example."
    )
    n_valid: int = Field(
        default=256,
        ge=8,
        le=100_000,
        description="Synthetic validation examples (fixed, from seed).",
    )

    @pydantic.model_validator(mode="after")
    def _check_layout(self) -> Self:
        """Reject combinations that cannot produce a well-formed example."""
        if self.kind == "lm":
            if self.data_dir is None:
                raise ValueError("data_dir is required when kind='lm'")
            for name in ("train_split", "valid_split"):
                stem: str = getattr(self, name)
                if not stem or "/" in stem or "\\" in stem or stem in (".", ".."):
                    raise ValueError(f"{name} must be a plain file stem, got {stem!r}")
        elif self.kind == "associative_recall":
            if self.n_pairs > self.n_symbols:
                raise ValueError(
                    f"n_pairs ({self.n_pairs}) must be <= n_symbols ({self.n_symbols}) "
                    "so that the keys of one example are distinct"
                )
            need = 2 * self.n_pairs + 2
            if self.seq_len < need:
                raise ValueError(
                    f"seq_len ({self.seq_len}) must be >= 2 * n_pairs + 2 = {need} "
                    "for associative_recall"
                )
        else:  # sort / copy: L = (seq_len - 1) // 2 symbols, a separator, L symbols
            if (self.seq_len - 1) // 2 < 1:
                raise ValueError(f"seq_len ({self.seq_len}) must be >= 3 for {self.kind}")
        return self


def _refuse(cls_name: str, loc: tuple[str, ...], value: object, msg: str) -> ValidationError:
    """A ValidationError located at `loc` (relative to the model raising it), so a study spec
    names the field that is refused (e.g. base.model.position), not the whole section."""
    detail = InitErrorDetails(
        type="value_error", loc=loc, input=value, ctx={"error": ValueError(msg)}
    )
    return ValidationError.from_exception_data(cls_name, [detail])


BlockPreset = Literal["custom", "pure", "attn_mlp", "attn_mlp_skip", "attn_skip", "full"]
# (skip, mlp, mlp_skip) of each named variant of Dong et al. 2021. "attn_mlp" is attention + MLP
# with no residual anywhere; "attn_mlp_skip" is the variant of the authors' code
# (twistedcubic/attention-rank-collapse, walking_casual_transformers.ipynb): the residual around
# attention is removed but the MLP sublayer keeps its own.
BLOCK_PRESETS: dict[str, tuple[bool, bool, bool]] = {
    "pure": (False, False, False),
    "attn_mlp": (False, True, False),
    "attn_mlp_skip": (False, True, True),
    "attn_skip": (True, False, True),
    "full": (True, True, True),
}


class ModelConfig(BaseModel):
    """Architecture of one trial's model (vocabulary and context come from the task)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    n_layers: int = Field(2, ge=1, le=64)
    n_heads: int = Field(2, ge=1, le=64)
    d_model: int = Field(64, ge=4, le=8192)
    d_ff: int = Field(256, ge=4, le=32768)
    norm: Literal["pre", "post", "none"] = "pre"
    skip: bool = True  # residual connection around attention (and the MLP unless mlp_skip says)
    mlp: bool = True
    mlp_skip: bool | None = None  # residual around the MLP; None = the same as `skip`
    # A named Dong et al. variant; anything but "custom" sets skip, mlp and mlp_skip.
    block: BlockPreset = "custom"
    qk_norm: Literal["none", "layernorm", "rmsnorm", "sigma_reparam"] = Field(
        "none",
        description=(
            "Normalisation of the queries and keys per head before the logits: LayerNorm or "
            "RMSNorm (each with a learned scale; LayerNorm also a bias), or sigma-reparam of "
            "the query and key projections (Zhai et al. 2023)."
        ),
    )
    norm_type: Literal["layernorm", "rmsnorm"] = Field(
        "layernorm",
        description=(
            "The block and final norms (wherever `norm` puts one): LayerNorm, or RMSNorm "
            "(torch.nn.RMSNorm: a learned scale, no bias, no mean subtraction; Llama)."
        ),
    )
    position: Literal["learned", "rotary"] = Field(
        "learned",
        description=(
            "Position information: a learned embedding added to the tokens (GPT-2), or rotary "
            "embeddings (RoPE, base 10000, the rotate-half form) applied to q and k of every "
            "head after the QK norm (Llama); needs an even head width."
        ),
    )
    mlp_type: Literal["gelu", "swiglu"] = Field(
        "gelu",
        description=(
            "The MLP: proj(gelu(fc x)), or SwiGLU proj(silu(gate x) * (up x)) with gate and up "
            "of width d_ff each (one fc of 2 d_ff outputs; 1.5x the parameters of gelu at the "
            "same d_ff: Llama uses d_ff = 8/3 d_model)."
        ),
    )
    sigma_reparam: Literal["none", "all"] = Field(
        "none",
        description=(
            "all: every linear layer of every block (q, k, v, output, MLP) is "
            "W_hat = gamma / sigma(W) * W, sigma by one power iteration a training step, gamma "
            "learned and initialised to sigma(W) (Zhai et al. 2023). The query/key-only "
            "variant is qk_norm: sigma_reparam."
        ),
    )
    qk_init_std: float = Field(0.02, gt=0.0, le=10.0)
    mlp_init_std: float = Field(
        0.02,
        gt=0.0,
        le=1.0,
        description=(
            "Init std of both MLP weight matrices (fc and proj); every other weight but the "
            "query/key projections keeps 0.02 (GPT). At 0.02 the MLP is nearly linear and "
            "small next to its input (pre-activations ~0.02 sqrt(d_model)); about "
            "1/sqrt(d_model) puts GELU in its non-linear regime and the MLP's output on the "
            "scale of its input; the MLP's Lipschitz constant at init grows as "
            "mlp_init_std^2 (large values: the regime of Dong et al.'s claim that MLPs slow "
            "rank collapse). An init scale only: per trial, fusable."
        ),
    )
    init_scheme: Literal["gpt", "token_scale"] = Field(
        "gpt",
        description=(
            "gpt: every weight std 0.02 but the QK and MLP scales above (nanoGPT). "
            "token_scale: the same draws rescaled so that attention keeps the token scale "
            "without any LayerNorm (Dong et al.'s pure self-attention network): token and "
            "position embeddings std 1/sqrt(2) (their sum has unit-variance entries, the "
            "scale a LayerNorm would give), value and output projections std 1/sqrt(d_model) "
            "(W_O W_V keeps a token's norm in expectation); the QK and MLP scales are "
            "unchanged. With norm none, the logits of every layer then see tokens of norm "
            "about sqrt(d_model), where GPT init shrinks them by ~0.013 a layer. An init "
            "scale only: per trial, fusable."
        ),
    )
    embed_scale: Literal["none", "sqrt_d"] = Field(
        "none",
        description=(
            "none: the token embedding enters as drawn (GPT, std 0.02). sqrt_d: fairseq's "
            "token embedding (Bao et al.'s model): drawn with std 1/sqrt(d_model) (the 0.02 "
            "draw rescaled, nothing more drawn) and multiplied by sqrt(d_model) on the way "
            "in, so its entries have unit scale; the tied output head uses the unscaled "
            "weight, as fairseq's shared decoder embedding does. Learned positions (std "
            "0.02) are added after the scaling, as fairseq adds its sinusoidal ones. "
            "Refused with init_scheme: token_scale (both set the token scale)."
        ),
    )
    attn_temperature: float = Field(1.0, gt=0.0, le=100.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    causal: bool = Field(
        True,
        description=(
            "Causal mask on attention (a decoder). false: bidirectional attention, every "
            "query sees every key, as in Dong et al.'s theorem and the authors' BERT; only "
            "sound for a task whose targets are not among its inputs at later positions "
            "(associative recall: the one target is at the last position), and refused for "
            "lm, sort and copy, where every query would see its answer. Probes then "
            "normalise by n_i = S keys (docs/metrics.md sections 1, 7)."
        ),
    )

    @model_validator(mode="after")
    def _apply_block_preset(self) -> ModelConfig:
        if self.block != "custom":
            self.skip, self.mlp, self.mlp_skip = BLOCK_PRESETS[self.block]
        return self

    @property
    def mlp_residual(self) -> bool:
        """Whether the MLP sublayer adds its input back (its own skip connection)."""
        return self.skip if self.mlp_skip is None else self.mlp_skip

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        return self

    @model_validator(mode="after")
    def _options_fit_together(self) -> ModelConfig:
        """Refuse option combinations that mean nothing or cannot be built, naming the
        option that is refused (a 422 at base.model.<field> in a study)."""
        name = type(self).__name__
        if self.position == "rotary" and self.d_head % 2 != 0:
            raise _refuse(
                name,
                ("position",),
                self.position,
                f"position: rotary needs an even head width; d_model / n_heads = {self.d_head}",
            )
        if self.sigma_reparam == "all" and self.qk_norm == "sigma_reparam":
            raise _refuse(
                name,
                ("sigma_reparam",),
                self.sigma_reparam,
                "sigma_reparam: all already reparametrises the query and key projections; "
                "use qk_norm: none (or layernorm/rmsnorm) with it, or qk_norm: sigma_reparam "
                "alone for the query/key-only variant",
            )
        if self.embed_scale != "none" and self.init_scheme == "token_scale":
            raise _refuse(
                name,
                ("embed_scale",),
                self.embed_scale,
                "embed_scale: sqrt_d sets the token scale itself (fairseq's embedding); "
                "use it with init_scheme: gpt, or init_scheme: token_scale with embed_scale: "
                "none",
            )
        if self.norm_type == "rmsnorm" and self.norm == "none":
            raise _refuse(
                name,
                ("norm_type",),
                self.norm_type,
                "norm_type: rmsnorm with norm: none has no norm to make an RMSNorm; "
                "use norm: pre or post",
            )
        if self.mlp_type == "swiglu" and not self.mlp:
            raise _refuse(
                name,
                ("mlp_type",),
                self.mlp_type,
                "mlp_type: swiglu with no MLP (mlp: false, or a block preset without one)",
            )
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


class RegularizerConfig(BaseModel):
    """The eigenspectrum penalty added to the task loss (docs/metrics.md section 4)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    kind: RegularizerKind = "none"
    lam: float = Field(0.0, ge=0.0, le=1e6, alias="lambda")
    target_mean: float = Field(
        0.0,
        ge=-1e3,
        le=1e3,
        description=(
            "locater only: the t of var + (mean - t)^2, the mean over D eigenvalues of "
            "(lambda_i - t)^2. It holds the eigen-mean over the head's rank, tr(W)/d_h "
            "(`qk_eig_mean_rank`), at t; the D-mean tr(W)/D (`qk_eig_mean`) is held at "
            "t * d_h / D (t itself only for one full-width head, d_h = D; two heads: t / 2). "
            "t = 0 is plain shrinkage of W's symmetric part (docs/metrics.md section 4)."
        ),
    )


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "cosine"
    grad_clip: float | None = Field(1.0, gt=0.0)
    weight_decay_mode: Literal["coupled", "independent"] = Field(
        "coupled",
        description=(
            "AdamW's decay step: coupled (torch's AdamW) decays p by lr * weight_decay * p, "
            "where lr includes its schedule; independent (Wortsman et al. 2023) by "
            "weight_decay * schedule_multiplier * p, so the decay does not grow with the "
            "learning rate (weight_decay ~1e-4 there, not ~0.1). adamw only."
        ),
    )

    @model_validator(mode="after")
    def _independent_decay_is_adamw(self) -> OptimConfig:
        if self.weight_decay_mode == "independent" and self.name != "adamw":
            raise _refuse(
                type(self).__name__,
                ("weight_decay_mode",),
                self.weight_decay_mode,
                f"weight_decay_mode: independent is an AdamW option; optim.name is {self.name!r}",
            )
        return self

    @property
    def torch_weight_decay(self) -> float:
        """The weight decay to give torch's AdamW (which decays by lr * wd): `weight_decay`
        when coupled; `weight_decay / lr` when independent, so that lr * wd is
        weight_decay times the schedule's multiplier."""
        if self.weight_decay_mode == "independent":
            return self.weight_decay / self.lr
        return self.weight_decay


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dir: str | None = None  # where checkpoints go; None = no checkpoints
    every_evals: int = Field(1, ge=1)
    # Who the directory belongs to (set by the study runner): a directory left by another run
    # is emptied before it is read (workers/checkpoints.py). None = not checked.
    owner: str | None = None


class TrialConfig(BaseModel):
    """Everything that determines one trial; same config + seed on CPU = same loss curve."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    regularizer: RegularizerConfig = Field(default_factory=RegularizerConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    batch_size: int = Field(32, ge=1, le=4096)
    z_loss_coef: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description=(
            "z-loss (docs/metrics.md section 9): z_loss_coef * mean over the positions with a "
            "target of (log Z_t)^2 added to the training loss, in float32 outside autocast "
            "(PaLM and Wortsman et al.: 1e-4). 0: no term at all."
        ),
    )
    steps: int = Field(
        300,
        ge=0,
        le=10_000_000,
        description="Training steps; 0 (with eval_at_init) measures the untrained model only.",
    )
    eval_every: int = Field(50, ge=1)
    # also evaluate and report the untrained model, as step 0 (needed with steps 0)
    eval_at_init: bool = Field(False, validate_default=True)
    eval_batches: int = Field(4, ge=1, le=1000)
    probe_batch_size: int = Field(8, ge=1, le=256)
    seed: int = Field(0, ge=0, lt=2**31)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # float64: weights, activations and probes in double precision (the rank ratio's floor
    # is then ~1e-16 of the layer output, not float32's ~1e-7; docs/metrics.md section 8).
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    entropy_collapse_threshold: float = Field(0.1, ge=0.0, le=1.0)
    rank_collapse_threshold: float = Field(0.05, ge=0.0, le=1.0)
    plateau_window: int = Field(3, ge=1)
    plateau_rel_tol: float = Field(0.01, ge=0.0, le=1.0)
    trapped_rel_gap: float = Field(0.1, ge=0.0)
    # torch.compile the training forward (not the probes). Off by default: at the small
    # sizes qkscope studies, compilation costs more than it saves (bench/README.md).
    compile: bool = False

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrialConfig:
        if self.optim.warmup_steps > self.steps:
            raise ValueError(
                f"optim.warmup_steps ({self.optim.warmup_steps}) exceeds steps ({self.steps})"
            )
        return self

    @model_validator(mode="after")
    def _mask_hides_the_targets(self) -> TrialConfig:
        """Bidirectional attention on a task whose targets are later inputs leaks the answer:
        refused, with the error located at model.causal (a ValidationError raised here keeps
        its own location, so a study spec reports base.model.causal)."""
        why = CAUSAL_ONLY_TASKS.get(self.task.kind)
        if why is None or self.model.causal:
            return self
        msg = (
            f"model.causal: false is refused for task.kind {self.task.kind!r}: {why}, so "
            "bidirectional attention would see the token each position must predict; use "
            "model.causal: true, or a task whose targets are not later inputs "
            "(associative_recall)"
        )
        detail = InitErrorDetails(
            type="value_error",
            loc=("model", "causal"),
            input=self.model.causal,
            ctx={"error": ValueError(msg)},
        )
        raise ValidationError.from_exception_data(type(self).__name__, [detail])

    @field_validator("steps", mode="before")
    @classmethod
    def _steps_not_a_boolean(cls, v: object) -> object:
        """false is not 0 steps (it would ask for a zero-step trial): refused by name."""
        if isinstance(v, bool):
            raise ValueError("expected a number, got a boolean")
        return v

    @field_validator("eval_at_init")
    @classmethod
    def _zero_steps_measure_init(cls, v: bool, info: ValidationInfo) -> bool:
        """Named on `eval_at_init` (declared after `steps`, so it sees it): the field that
        makes a zero-step trial valid."""
        if info.data.get("steps") == 0 and not v:
            raise ValueError(
                "steps is 0: set eval_at_init: true (a zero-step trial measures only the "
                "untrained model, as step 0)"
            )
        return v


@dataclass(frozen=True)
class MetricPoint:
    """One measured number: layer/head are None where they do not apply."""

    name: str
    value: float
    layer: int | None = None
    head: int | None = None


TrialStatus = Literal["completed", "pruned", "diverged"]


class TrialSummary(BaseModel):
    """What one trial ended with. Non-finite numbers are stored as None."""

    status: TrialStatus
    steps_done: int
    final_train_loss: float | None = None
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    min_norm_entropy: float | None = None  # at the final evaluation, over layers and heads
    min_norm_entropy_ever: float | None = None  # over every evaluation
    final_rank_ratio: float | None = None  # last layer, final evaluation, batch mean
    qk_eig_var: float | None = None  # mean over layers and heads, final evaluation
    qk_eig_mean: float | None = None  # tr(W)/D: with d_h < D, target_mean * d_h / D at best
    qk_eig_mean_rank: float | None = None  # tr(W)/d_h, what a locater penalty holds at target
    entropy_collapse: bool = False
    rank_collapse: bool = False
    plateaus: list[tuple[int, int]] = Field(default_factory=list)
    plateau_count: int = 0
    plateau_steps: int = 0
    longest_plateau: int = 0
    trapped: bool = False
    diverged_at_step: int | None = None
    # Why a pruned trial stopped: a constraint it could no longer meet (decided by the worker,
    # workers/stopping.py) or the pruner's verdict (the service's words).
    stop_reason: str | None = None
    eval_steps: list[int] = Field(default_factory=list)  # training evaluations (step >= 1)
    val_losses: list[float | None] = Field(default_factory=list)
    # The untrained model (step 0), with `eval_at_init` only; same reductions as the final ones.
    init_val_loss: float | None = None
    init_min_norm_entropy: float | None = None
    init_rank_ratio: float | None = None
    init_qk_eig_var: float | None = None
    # Attention concentration (docs/metrics.md section 7), mean over layers and heads, final
    # evaluation; target mass only for tasks that know the answer's position.
    top1_mass: float | None = None
    target_mass: float | None = None
    # Instability signals (docs/metrics.md section 9), on the probe batch: the largest
    # |attention logit| over layers and heads at the last evaluation and over every
    # evaluation, and the largest |mean log Z| of the output logits over every evaluation.
    max_attn_logit: float | None = None
    max_attn_logit_ever: float | None = None
    max_abs_output_log_z_ever: float | None = None
    # Provenance: a hash of the trial's config (checkpoint location left out) and the code
    # commit that trained it ("+dirty" when tracked files differed from it).
    config_hash: str | None = None
    code_commit: str | None = None
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0
    device: str = "cpu"
