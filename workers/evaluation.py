"""What a trial measures: the evaluation at each `eval_every` step and the summary at its end.

`probe_metrics` is every docs/metrics.md quantity per layer and head on a fixed probe batch;
`val_loss` the validation loss; `History` the per-evaluation numbers a summary is made from
(kept in the checkpoint); `summarize` the `TrialSummary`. The trial engine (workers/engine.py)
calls these for every member, alone or fused, so a trial means the same however it ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers import metrics as M
from workers.config import MetricPoint, RegularizerConfig, TrialConfig, TrialStatus, TrialSummary
from workers.models import QKModel
from workers.provenance import code_commit, config_hash
from workers.regularizers import model_penalty
from workers.tasks import Task

__all__ = [
    "History",
    "init_points",
    "intermediate_value",
    "penalty",
    "probe_metrics",
    "summarize",
    "val_loss",
]


def penalty(model: QKModel, reg: RegularizerConfig) -> Tensor:
    """The regularizer's value on the model: mean over layers and heads."""
    return model_penalty(model.qk_weights(), reg.kind, reg.target_mean)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _wide(x: Tensor) -> Tensor:
    """float32 or wider: float64 probes stay float64 (their floor is what they are for)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def probe_metrics(
    model: QKModel, probe_x: Tensor, probe_targets: Tensor | None = None
) -> list[MetricPoint]:
    """Every docs/metrics.md quantity per layer (1..L; 0 = embeddings for rank) and head.

    `probe_targets` (B, T), the answer's key position per query (-1: none; see
    `Task.attention_targets`), adds the target mass; without it, it is not stored.
    """
    was_training = model.training
    model.eval()
    out = model.probe(probe_x)
    causal = model.causal
    points: list[MetricPoint] = []
    for layer, attn in enumerate(out.attn, start=1):
        per_head = {
            "attn_entropy": M.attention_entropy(attn).tolist(),
            "attn_entropy_norm": M.normalized_attention_entropy(attn, causal=causal).tolist(),
            "attn_top1_mass": M.attention_top1_mass(attn, causal=causal).tolist(),
        }
        if probe_targets is not None:
            per_head["attn_target_mass"] = M.attention_target_mass(attn, probe_targets).tolist()
        q, k = out.qk[layer - 1]
        # the q, k this probe just made the attention from, at the model's own scale
        per_head["attn_logit_max"] = M.attention_logit_max(
            q, k, causal=causal, scale=out.layer_scale(layer - 1)
        ).tolist()
        for name, values in per_head.items():
            points.extend(MetricPoint(name, v, layer, h) for h, v in enumerate(values))
    points.append(MetricPoint("output_log_z", float(M.output_log_z(out.logits))))
    for layer, hidden in enumerate(out.hidden):
        ratio = M.rank_collapse_ratio(_wide(hidden)).mean().item()
        points.append(MetricPoint("rank_ratio", ratio, layer))
    gains = model.qk_input_gains()
    for layer, (w_q, w_k) in enumerate(model.qk_weights(), start=1):
        mean, var = M.qk_eigen_stats_factored(_wide(w_q), _wide(w_k))
        for h, (m, v) in enumerate(zip(mean.tolist(), var.tolist(), strict=True)):
            points.append(MetricPoint("qk_eig_mean", m, layer, h))
            points.append(MetricPoint("qk_eig_var", v, layer, h))
        gain = gains[layer - 1]
        if gain is not None:  # Pre-LN: the form diag(g) W diag(g) that sets the logits
            e_mean, e_var = M.qk_effective_eigen_stats(_wide(w_q), _wide(w_k), _wide(gain))
            for h, (m, v) in enumerate(zip(e_mean.tolist(), e_var.tolist(), strict=True)):
                points.append(MetricPoint("qk_eff_eig_mean", m, layer, h))
                points.append(MetricPoint("qk_eff_eig_var", v, layer, h))
        for h, r in enumerate(M.qk_eig_mean_rank(_wide(w_q), _wide(w_k)).tolist()):
            points.append(MetricPoint("qk_eig_mean_rank", r, layer, h))
    model.train(was_training)
    return points


@torch.no_grad()
def val_loss(
    model: QKModel, batches: list[tuple[Tensor, Tensor]], ctx: Any, dev: torch.device
) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        with ctx:
            _, loss = model(x.to(dev), y.to(dev))
        assert loss is not None
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


def init_points(
    model: QKModel,
    val_batches: list[tuple[Tensor, Tensor]],
    ctx: Any,
    dev: torch.device,
    reg: RegularizerConfig,
    probe_x: Tensor,
    probe_targets: Tensor | None = None,
) -> list[MetricPoint]:
    """The step-0 evaluation: validation loss, penalty and probe metrics; no train loss."""
    points = [MetricPoint("val_loss", val_loss(model, val_batches, ctx, dev))]
    if reg.kind != "none" and reg.lam != 0.0:
        with torch.no_grad(), ctx:
            points.append(MetricPoint("reg_penalty", float(penalty(model, reg))))
    return points + probe_metrics(model, probe_x, probe_targets)


@dataclass
class History:
    """The per-evaluation numbers the summary is made from (kept in the checkpoint).

    `steps` .. `last_points` cover training evaluations only; `init_points` is the
    step-0 evaluation (None when `eval_at_init` is off or it has not run yet; a plain
    class default, so checkpoints written before the field existed still load).
    """

    steps: list[int]
    val_losses: list[float]
    train_losses: list[float]
    min_norm_entropies: list[float]
    last_points: list[MetricPoint]
    init_points: list[MetricPoint] | None = None
    # Per training evaluation, the largest attn_logit_max over layers and heads and
    # |output_log_z| (`_signal`: +inf where a value was not finite, NaN where none was
    # measured): their running maxima are summaries. Plain class defaults, so checkpoints
    # written before them still load (then the maxima cover the evaluations since the
    # resume, and step 0). Checkpoints written before non-finite values counted kept NaN for
    # them too: read as not measured.
    max_attn_logits: list[float] | None = None
    abs_output_log_zs: list[float] | None = None

    def record_signals(self, points: list[MetricPoint]) -> None:
        """Keep one training evaluation's instability signals (docs/metrics.md section 9)."""
        logit, log_z = _signals(points)
        self.max_attn_logits = [*(self.max_attn_logits or []), logit]
        self.abs_output_log_zs = [*(self.abs_output_log_zs or []), log_z]

    @classmethod
    def empty(cls) -> History:
        return cls([], [], [], [], [])


def _max_of(values: list[float]) -> float | None:
    """The largest value, None when there is none or one is not finite (as the registry's
    `within: max` reduces an evaluation, workers/metric_names.py)."""
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return max(values)


def _signal(values: list[float]) -> float:
    """One evaluation's instability signal (docs/metrics.md section 9): the largest value,
    +inf when one is not finite (an overflow is the strongest signal there is, never
    skipped), NaN when nothing was measured."""
    if not values:
        return math.nan
    if not all(math.isfinite(v) for v in values):
        return math.inf
    return max(values)


def _signals(points: list[MetricPoint]) -> tuple[float, float]:
    """The largest attn_logit_max over layers and heads and |output_log_z| of one
    evaluation, as `_signal` gives them."""
    logits = [p.value for p in points if p.name == "attn_logit_max"]
    log_z = [abs(p.value) for p in points if p.name == "output_log_z"]
    return _signal(logits), _signal(log_z)


def _running_max(values: list[float]) -> float | None:
    """The largest signal of the evaluations so far (a running maximum; +inf once one was
    not finite), or None when none was measured (NaN: not measured)."""
    measured = [v for v in values if not math.isnan(v)]
    return max(measured) if measured else None


@dataclass(frozen=True)
class _PointStats:
    """The summary's reductions of one evaluation's metric points."""

    val_loss: float | None
    min_norm_entropy: float | None  # smallest over layers and heads
    rank_ratio: float | None  # last layer
    qk_eig_var: float | None  # mean over layers and heads
    qk_eig_mean: float | None
    qk_eig_mean_rank: float | None
    top1_mass: float | None  # mean over layers and heads
    target_mass: float | None
    max_attn_logit: float | None  # largest over layers and heads


def _point_stats(points: list[MetricPoint]) -> _PointStats:
    by_name: dict[str, list[MetricPoint]] = {}
    for p in points:
        by_name.setdefault(p.name, []).append(p)

    def mean_of(name: str) -> float | None:
        vals = [p.value for p in by_name.get(name, [])]
        return _finite(sum(vals) / len(vals)) if vals else None

    val = by_name.get("val_loss", [])
    norm_ent = [p.value for p in by_name.get("attn_entropy_norm", [])]
    ranks = sorted(by_name.get("rank_ratio", []), key=lambda p: p.layer or 0)
    return _PointStats(
        val_loss=_finite(val[0].value) if val else None,
        min_norm_entropy=_finite(min(norm_ent)) if norm_ent else None,
        rank_ratio=_finite(ranks[-1].value) if ranks else None,
        qk_eig_var=mean_of("qk_eig_var"),
        qk_eig_mean=mean_of("qk_eig_mean"),
        qk_eig_mean_rank=mean_of("qk_eig_mean_rank"),
        top1_mass=mean_of("attn_top1_mass"),
        target_mass=mean_of("attn_target_mass"),
        max_attn_logit=_max_of([p.value for p in by_name.get("attn_logit_max", [])]),
    )


def summarize(
    config: TrialConfig,
    task: Task,
    hist: History,
    status: TrialStatus,
    steps_done: int,
    diverged_at: int | None,
    elapsed: float,
    device: torch.device,
) -> TrialSummary:
    s = TrialSummary(status=status, steps_done=steps_done, diverged_at_step=diverged_at)
    s.wall_time_s = elapsed
    s.tokens_per_s = steps_done * config.batch_size * task.seq_len / max(elapsed, 1e-9)
    s.device = str(device)
    s.config_hash, s.code_commit = config_hash(config), code_commit()
    s.eval_steps = list(hist.steps)
    s.val_losses = [_finite(v) for v in hist.val_losses]
    logits, log_zs = list(hist.max_attn_logits or []), list(hist.abs_output_log_zs or [])
    if hist.init_points is not None:
        init = _point_stats(hist.init_points)
        s.init_val_loss, s.init_min_norm_entropy = init.val_loss, init.min_norm_entropy
        s.init_rank_ratio, s.init_qk_eig_var = init.rank_ratio, init.qk_eig_var
        init_logit, init_log_z = _signals(hist.init_points)
        logits, log_zs = [init_logit, *logits], [init_log_z, *log_zs]
    # The running maxima start at step 0 (METRICS.md 9), so they have a value even before
    # the first training evaluation.
    s.max_attn_logit_ever = _running_max(logits)
    s.max_abs_output_log_z_ever = _running_max(log_zs)
    if not hist.steps:
        return s
    finite_vals = [v for v in hist.val_losses if math.isfinite(v)]
    s.final_train_loss = _finite(hist.train_losses[-1])
    s.final_val_loss = _finite(hist.val_losses[-1])
    s.best_val_loss = min(finite_vals) if finite_vals else None
    last = _point_stats(hist.last_points)
    s.min_norm_entropy = last.min_norm_entropy
    if any(p.name == "attn_entropy_norm" for p in hist.last_points):
        s.min_norm_entropy_ever = _finite(min(hist.min_norm_entropies))
    s.final_rank_ratio = last.rank_ratio
    s.qk_eig_var, s.qk_eig_mean = last.qk_eig_var, last.qk_eig_mean
    s.qk_eig_mean_rank = last.qk_eig_mean_rank
    s.top1_mass, s.target_mass = last.top1_mass, last.target_mass
    s.max_attn_logit = last.max_attn_logit
    s.entropy_collapse = (
        s.min_norm_entropy is not None and s.min_norm_entropy < config.entropy_collapse_threshold
    )
    s.rank_collapse = (
        s.final_rank_ratio is not None and s.final_rank_ratio < config.rank_collapse_threshold
    )
    if len(finite_vals) == len(hist.val_losses):
        s.plateaus = M.detect_plateaus(
            hist.steps, hist.val_losses, config.plateau_window, config.plateau_rel_tol
        )
        stats = M.plateau_stats(s.plateaus, hist.steps[-1])
        s.plateau_count = stats["plateau_count"]
        s.plateau_steps = stats["plateau_steps"]
        s.longest_plateau = stats["longest_plateau"]
        s.trapped = M.is_trapped(
            s.plateaus,
            hist.steps[-1],
            hist.val_losses[-1],
            task.known_optimum,
            config.trapped_rel_gap,
        )
    return s


def intermediate_value(summary: TrialSummary, metric: str) -> float | None:
    """What Optuna's pruner compares after an evaluation: the summary's `metric` had the
    trial stopped there (`summary` made by `summarize` at that step), as a float; None when
    the registry gives the metric no intermediate value, or it is missing or NaN. A running
    maximum that overflowed is +inf (Optuna takes it; the runner tells the pruner the
    objective's worst value, as it tells a final non-finite one)."""
    from workers.metric_names import SUMMARY_BY_NAME

    entry = SUMMARY_BY_NAME.get(metric)
    if entry is None or not entry.intermediate:
        raise ValueError(f"{metric!r} has no intermediate value")
    value = getattr(summary, metric)
    if value is None or isinstance(value, bool):
        return None
    value = float(value)
    return None if math.isnan(value) else value
