"""The configuration and result types of one trial, importable without torch.

The service (spec validation, the API, the runner) needs these types but never trains;
keeping them here, free of torch, saves every service process torch's import time
(about a second and a few hundred MB). `workers.trial`, `workers.model`, `workers.tasks`
and `workers.regularizers` re-export them from where they used to live.

The sections of a config (`TaskConfig`, `ModelConfig`, `RegularizerConfig`, `OptimConfig`,
`CheckpointConfig`) live in workers/config_sections.py and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

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

from workers.config_sections import (
    BLOCK_PRESETS,
    CAUSAL_ONLY_TASKS,
    BlockPreset,
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    RegularizerConfig,
    RegularizerKind,
    TaskConfig,
)

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
    def _hf_positions_fit(self) -> TrialConfig:
        """An hf model is built for at most its positions key's tokens: the task's seq_len
        must fit (refused at model.hf.config.<key>)."""
        hf = self.model.hf
        if self.model.kind != "hf" or hf is None:
            return self
        from workers.hf_families import HF_FAMILIES, hf_shape

        key = HF_FAMILIES[hf.model_type].positions
        positions = hf_shape(hf.model_type, hf.config).positions
        if positions < self.task.seq_len:
            detail = InitErrorDetails(
                type="value_error",
                loc=("model", "hf", "config", key),
                input=positions,
                ctx={
                    "error": ValueError(
                        f"{key} ({positions}) is shorter than task.seq_len ({self.task.seq_len})"
                    )
                },
            )
            raise ValidationError.from_exception_data(type(self).__name__, [detail])
        return self

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


class TrialStatus(StrEnum):
    """How a member ended: trained to its last step, stopped early (a constraint it can no
    longer meet, or the pruner's verdict), or its loss went non-finite. A str, so it reads and
    serialises as its value."""

    COMPLETED = "completed"
    PRUNED = "pruned"
    DIVERGED = "diverged"


class TrialSummary(BaseModel):
    """What one trial ended with. Non-finite numbers are stored as None, except in the
    running maxima of docs/metrics.md section 9 (`max_attn_logit_ever`,
    `max_abs_output_log_z_ever`), where a non-finite value counts as +inf."""

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
    # evaluation, and the largest |mean log Z| of the output logits over every evaluation
    # (both running maxima from step 0 with eval_at_init; +inf once a value overflowed).
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
