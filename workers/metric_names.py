"""The one registry of metric names: what each stored number is called and what it means.

Two kinds of metric, both defined in METRICS.md terms (the reference is `docs/`):

- a *series* is measured at every evaluation and stored as metric rows (name, layer,
  head, step, value); `index` says whether it has a layer, a layer and a head, or neither;
- a *summary* is one number (or flag) per trial, in the trial's summary; `column` says
  whether the results table also keeps it in a column of its own (filtering and sorting
  work on every summary either way).

A summary says how it is made from a series: `within` reduces one evaluation's values
(over layers and heads), `over` reduces the evaluations. `intermediate` marks the
summaries that can be computed after any evaluation as "the value if the trial stopped
here", which is what Optuna's pruners compare; `objective` marks those a study may
optimise or constrain.

Everything else derives from this module: the spec's metric names, the trial columns, the
`where=`/`sort=` fields, the export and plot fields, the metric route's names and the
intermediate values for pruning. It imports nothing heavy (no torch), so the API, the
runner and a client can all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "COLUMN_SUMMARIES",
    "FLAG_SUMMARIES",
    "INTERMEDIATE_SUMMARIES",
    "NUMERIC_SUMMARIES",
    "OBJECTIVE_SUMMARIES",
    "SERIES",
    "SERIES_NAMES",
    "SUMMARIES",
    "SUMMARY_NAMES",
    "Series",
    "Summary",
    "series_by_index",
]

Index = Literal["none", "layer", "head"]
# How one evaluation's values of the source series are reduced to one number.
# ("abs": the absolute value of the one value an evaluation has.)
Within = Literal["one", "abs", "min", "max", "mean", "last_layer"]
# How the evaluations are reduced: the last one, the smallest or the largest over all of
# them (a running minimum or maximum), the escaped/longest plateaus of the validation-loss
# curve (METRICS.md 5), a threshold on another summary, the untrained model's evaluation
# (step 0), or the study's reference.
Over = Literal["final", "min", "max", "plateaus", "threshold", "init", "study"]
ValueType = Literal["float", "int", "bool"]


@dataclass(frozen=True)
class Series:
    """A per-evaluation metric: stored as rows at every evaluation."""

    name: str
    meaning: str
    index: Index


@dataclass(frozen=True)
class Summary:
    """A per-trial metric: one value in the trial summary."""

    name: str
    meaning: str
    type: ValueType
    source: str | None  # the series (or summary, for a threshold) it is made from
    within: Within
    over: Over
    column: bool  # kept in a column of the trial table too
    intermediate: bool  # has a value after every evaluation, for pruning
    objective: bool  # a study may optimise or constrain it

    @property
    def moves(self) -> Literal["down", "up", "fixed", "any"]:
        """How its value can move as evaluations go on: a running minimum only goes down, a
        value of the untrained model is fixed; anything else may go either way. This is what
        says whether a violated constraint on it can still be undone (workers/stopping.py)."""
        if self.over == "min":
            return "down"
        if self.over == "max":
            return "up"
        if self.over == "init":
            return "fixed"
        return "any"

    @property
    def aggregate(self) -> str:
        """How it aggregates, in words: e.g. `final of mean over layers and heads`."""
        within = {
            "one": "",
            "abs": " of the absolute value",
            "min": " of the min over layers and heads",
            "max": " of the max over layers and heads",
            "mean": " of the mean over layers and heads",
            "last_layer": " of the last layer",
        }[self.within]
        return f"{self.over}{within}"


SERIES: tuple[Series, ...] = (
    Series("train_loss", "training cross-entropy of the step's batch (nats)", "none"),
    Series("val_loss", "mean validation cross-entropy over eval_batches (nats)", "none"),
    Series("grad_norm", "global gradient norm before clipping", "none"),
    Series("lr", "learning rate after the step's schedule update", "none"),
    Series("reg_penalty", "the regularizer's penalty, mean over layers and heads", "none"),
    Series("rank_ratio", "rank-collapse ratio of layer l's output (0: embeddings)", "layer"),
    Series("attn_entropy", "attention entropy of a head, mean over rows (nats)", "head"),
    Series("attn_entropy_norm", "attention entropy over log(keys attended), in [0, 1]", "head"),
    Series("qk_eig_mean", "mean eigenvalue of a head's QK bilinear form tr(W)/D", "head"),
    Series("qk_eig_var", "variance of the eigenvalues of the symmetric part of W", "head"),
    Series(
        "qk_eig_mean_rank", "eigen-mean over the head's rank tr(W)/d_h (locater's target)", "head"
    ),
    Series("qk_eff_eig_mean", "tr(G W G)/D, G = diag(gain of the Pre-LN norm before "
           "attention); Pre-LN only", "head"),
    Series("qk_eff_eig_var", "eigen-variance of the symmetric part of G W G; Pre-LN only",
           "head"),
    Series("attn_top1_mass", "largest attention weight per row, rescaled: 0 uniform, 1 one key",
           "head"),
    Series("attn_target_mass", "attention mass on the answer's key position (tasks with one)",
           "head"),
    Series("attn_logit_max", "largest |attention logit| of a head over the probe batch",
           "head"),
    Series("output_log_z", "mean log Z (logsumexp of the output logits) over the probe batch",
           "none"),
)  # fmt: skip

SUMMARIES: tuple[Summary, ...] = (
    Summary("final_val_loss", "validation loss at the last evaluation",
            "float", "val_loss", "one", "final", True, True, True),
    Summary("best_val_loss", "lowest validation loss of any evaluation",
            "float", "val_loss", "one", "min", False, True, True),
    Summary("final_train_loss", "training loss at the last evaluation",
            "float", "train_loss", "one", "final", False, True, True),
    Summary("min_norm_entropy", "smallest normalized entropy of any head, last evaluation",
            "float", "attn_entropy_norm", "min", "final", True, True, True),
    Summary("min_norm_entropy_ever", "smallest normalized entropy of any head, any evaluation",
            "float", "attn_entropy_norm", "min", "min", False, True, True),
    Summary("final_rank_ratio", "rank-collapse ratio of the last layer, last evaluation",
            "float", "rank_ratio", "last_layer", "final", True, True, True),
    Summary("qk_eig_var", "QK eigen-variance, mean over layers and heads, last evaluation",
            "float", "qk_eig_var", "mean", "final", True, True, True),
    Summary("qk_eig_mean", "QK eigen-mean, mean over layers and heads, last evaluation",
            "float", "qk_eig_mean", "mean", "final", False, True, True),
    Summary("qk_eig_mean_rank", "tr(W)/d_h (what target_mean holds), mean over layers and heads, "
            "last evaluation",
            "float", "qk_eig_mean_rank", "mean", "final", False, True, True),
    Summary("plateau_count", "validation-loss plateaus that training escaped",
            "int", "val_loss", "one", "plateaus", False, True, True),
    Summary("plateau_steps", "steps spent on escaped validation-loss plateaus",
            "int", "val_loss", "one", "plateaus", True, True, True),
    Summary("longest_plateau", "steps of the longest validation-loss plateau, escaped or not",
            "int", "val_loss", "one", "plateaus", False, True, True),
    Summary("entropy_collapse", "min_norm_entropy below entropy_collapse_threshold",
            "bool", "min_norm_entropy", "one", "threshold", True, False, False),
    Summary("rank_collapse", "final_rank_ratio below rank_collapse_threshold",
            "bool", "final_rank_ratio", "one", "threshold", True, False, False),
    Summary("trapped", "on a plateau at the end, more than trapped_rel_gap above the best loss",
            "bool", "val_loss", "one", "study", True, False, False),
    Summary("init_val_loss", "validation loss of the untrained model (eval_at_init)",
            "float", "val_loss", "one", "init", False, False, False),
    Summary("init_min_norm_entropy", "min_norm_entropy of the untrained model (eval_at_init)",
            "float", "attn_entropy_norm", "min", "init", False, False, False),
    Summary("init_rank_ratio", "final_rank_ratio of the untrained model (eval_at_init)",
            "float", "rank_ratio", "last_layer", "init", False, False, False),
    Summary("init_qk_eig_var", "qk_eig_var of the untrained model (eval_at_init)",
            "float", "qk_eig_var", "mean", "init", False, False, False),
    Summary("top1_mass", "attention top-1 mass, mean over layers and heads, last evaluation",
            "float", "attn_top1_mass", "mean", "final", False, True, True),
    Summary("target_mass", "attention mass on the answer, mean over layers and heads, last "
            "evaluation (tasks with an answer key)",
            "float", "attn_target_mass", "mean", "final", False, True, True),
    Summary("max_attn_logit", "largest |attention logit| of any layer and head, last evaluation",
            "float", "attn_logit_max", "max", "final", False, True, True),
    Summary("max_attn_logit_ever", "largest |attention logit| of any layer and head, any "
            "evaluation",
            "float", "attn_logit_max", "max", "max", False, True, True),
    Summary("max_abs_output_log_z_ever", "largest |output_log_z| of any evaluation",
            "float", "output_log_z", "abs", "max", False, True, True),
)  # fmt: skip

SERIES_NAMES: tuple[str, ...] = tuple(s.name for s in SERIES)
SUMMARY_NAMES: tuple[str, ...] = tuple(s.name for s in SUMMARIES)
# Derived lists, in registry order.
NUMERIC_SUMMARIES: tuple[str, ...] = tuple(s.name for s in SUMMARIES if s.type != "bool")
FLAG_SUMMARIES: tuple[str, ...] = tuple(s.name for s in SUMMARIES if s.type == "bool")
COLUMN_SUMMARIES: tuple[str, ...] = tuple(s.name for s in SUMMARIES if s.column)
OBJECTIVE_SUMMARIES: tuple[str, ...] = tuple(s.name for s in SUMMARIES if s.objective)
INTERMEDIATE_SUMMARIES: tuple[str, ...] = tuple(s.name for s in SUMMARIES if s.intermediate)

SERIES_BY_NAME: dict[str, Series] = {s.name: s for s in SERIES}
SUMMARY_BY_NAME: dict[str, Summary] = {s.name: s for s in SUMMARIES}


def series_by_index(index: Index) -> tuple[str, ...]:
    """The series names measured per `index` ("none", "layer" or "head")."""
    return tuple(s.name for s in SERIES if s.index == index)
