"""The study definition's model: what a user POSTs to start a study (JSON or YAML).

A spec is a base trial config, a search space over dotted fields of that
config, a sampler/pruner, a budget and the objectives and constraints that
define a *stable* setting. Everything the model checks on its own is here, every error
carrying the dotted path of the field; the checks that need more (every point of the
search space, the deployment's limits, the data directory) are in service/spec/checks.py,
and service/spec/__init__.py is the one name for both.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from service.errors import InvalidField
from workers.config import TaskConfig, TrialConfig, TrialSummary
from workers.metric_names import INTERMEDIATE_SUMMARIES, OBJECTIVE_SUMMARIES

__all__ = [
    "HISTORY_FREE_SAMPLERS",
    "INFEASIBLE_PATIENCE",
    "MAX_FUSE",
    "MAX_INT",
    "SUMMARY_METRICS",
    "Budget",
    "CategoricalParam",
    "Constraint",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "Objective",
    "Param",
    "PrunerSpec",
    "Resources",
    "SamplerSpec",
    "Scalar",
    "SpecError",
    "StudySpec",
    "SummaryMetric",
    "apply_params",
    "count_params",
    "extremes",
    "summary_value",
    "vocab_size",
    "with_params",
]


def _summary_metric(name: str) -> str:
    if name not in OBJECTIVE_SUMMARIES:
        raise ValueError(
            f"unknown summary metric {name!r}; one of {', '.join(OBJECTIVE_SUMMARIES)}"
        )
    return name


# A TrialSummary number a study may optimise or constrain: the registry's objective metrics.
SummaryMetric = Annotated[
    str,
    AfterValidator(_summary_metric),
    WithJsonSchema({"type": "string", "enum": list(OBJECTIVE_SUMMARIES)}),
]
SUMMARY_METRICS: tuple[str, ...] = OBJECTIVE_SUMMARIES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _distinct(values: list[Any]) -> list[Any]:
    """`values` with no value twice (numbers compare as numbers: 1, 1.0 are one value; a
    boolean is not a number). Each repeat is a point the sampler and every check of the
    search space would take again: 1,000 copies of one choice in three fields asked the
    POST-time memory check for 1e9 points (issue 42)."""
    seen: dict[tuple[str, Any], int] = {}
    for i, v in enumerate(values):
        kind = "bool" if isinstance(v, bool) else "str" if isinstance(v, str) else "number"
        key = (kind, v)
        if key in seen:
            raise ValueError(f"value {i} ({v!r}) repeats value {seen[key]}: give each value once")
        seen[key] = i
    return values


class FloatParam(_Strict):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    grid: Annotated[list[float], AfterValidator(_distinct)] | None = Field(
        None, min_length=1, max_length=1000
    )

    @model_validator(mode="after")
    def _bounds(self) -> FloatParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}")
        return self


class IntParam(_Strict):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = Field(1, ge=1)
    grid: Annotated[list[int], AfterValidator(_distinct)] | None = Field(
        None, min_length=1, max_length=1000
    )

    @model_validator(mode="after")
    def _bounds(self) -> IntParam:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low}")
        if self.log and self.step != 1:
            # Optuna's suggest_int refuses it when the trial asks (a failed study, not a 422).
            raise ValueError(f"log: true needs step 1 (Optuna refuses it), got step {self.step}")
        return self


Scalar = str | int | float | bool


class CategoricalParam(_Strict):
    type: Literal["categorical"]
    choices: Annotated[list[Scalar], AfterValidator(_distinct)] = Field(
        min_length=1, max_length=1000
    )


class FixedParam(_Strict):
    type: Literal["fixed"]
    value: Scalar


Param = Annotated[
    FloatParam | IntParam | CategoricalParam | FixedParam, Field(discriminator="type")
]


# Evaluations in a row a constraint that can still be undone must be violated before the
# trial is stopped. bench/archive/infeasible_patience.py (2026-11-25, 48 random
# quickstart-space trials trained to the end, 8 evaluations each, 35 ending feasible): patience
# 1-2 would have stopped 2 trials that ended feasible, 3 one, 4 none while still stopping all
# 13 that ended infeasible (12 % of the steps saved; 5: 9 %, 8: none). 4 is the smallest with
# no false stop in that sample, which bounds the false-stop rate to about 3/35 (95 %), not to
# zero.
INFEASIBLE_PATIENCE = 4


class SamplerSpec(_Strict):
    kind: Literal["random", "grid", "tpe", "cmaes", "gp", "nsga2"] = "tpe"
    seed: int | None = Field(None, ge=0, lt=2**32)
    n_startup_trials: int = Field(4, ge=0, le=10_000)


class PrunerSpec(_Strict):
    kind: Literal["none", "median", "percentile", "hyperband", "successive_halving"] = "none"
    n_startup_trials: int = Field(2, ge=0, le=10_000)
    n_warmup_steps: int = Field(0, ge=0)
    percentile: float = Field(25.0, gt=0.0, lt=100.0)
    # Stop a trial once it can no longer meet the study's constraints (workers/stopping.py):
    # at once where the violation can never be undone (a running minimum below a lower
    # bound), else after it held for `infeasible_patience` evaluations in a row.
    stop_infeasible: bool = True
    infeasible_patience: int = Field(INFEASIBLE_PATIENCE, ge=1, le=1000)


class Budget(_Strict):
    n_trials: int = Field(ge=1)
    timeout_s: float | None = Field(None, gt=0.0)


class Objective(_Strict):
    metric: SummaryMetric = "final_val_loss"
    direction: Literal["minimize", "maximize"] = "minimize"


class Constraint(_Strict):
    """`metric op value`; value may be given as a fraction of the trial's steps."""

    metric: SummaryMetric
    op: Literal[">=", "<="]
    value: float | None = None
    fraction_of_steps: float | None = Field(None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _one_value(self) -> Constraint:
        if (self.value is None) == (self.fraction_of_steps is None):
            raise ValueError("give exactly one of value or fraction_of_steps")
        return self

    def violation(self, summary: dict[str, Any], steps: int) -> float:
        """Optuna's convention: <= 0 is feasible; a missing metric is infeasible."""
        bound = self.value if self.value is not None else (self.fraction_of_steps or 0.0) * steps
        x = summary.get(self.metric)
        if x is None:
            return 1e9
        return float(bound - x) if self.op == ">=" else float(x - bound)


class StabilitySpec(_Strict):
    """A width ladder (METRICS.md section 11, `GET /v1/studies/{id}/stability-boundary`):
    the study's grid over `optim.lr` x width x seed, then, per width and seed (and every
    other searched value), extra trials at `sqrt(eta_s eta_u)` between the largest stable and
    the smallest unstable learning rate above the best one, until `eta_u / eta_s <=
    bisect_factor` or the budget is spent (service/runner/ladder.py)."""

    # the parameter that is the width; default model.d_model / model.hf.config.hidden_size
    width: str | None = Field(None, min_length=1, max_length=200)
    # a trial is unstable above l* + tau (l_0 - l*) (METRICS.md 11)
    tau: float = Field(0.5, gt=0.0, le=1.0)
    # stop bisecting a width and seed once eta_u / eta_s is at most this; null: no bisection
    bisect_factor: float | None = Field(2**0.5, gt=1.0, le=1000.0)
    # metrics of the study's `constraints` whose violation counts as an instability
    instability_constraints: list[SummaryMetric] = Field(default_factory=list, max_length=32)


WIDTH_PARAMS = ("model.d_model", "model.hf.config.hidden_size")


class Resources(_Strict):
    cpus: float = Field(1.0, gt=0.0, le=256.0)
    gpus: float = Field(0.0, ge=0.0, le=16.0)


MAX_FUSE = 64  # one fused process holds at most this many trials
# Samplers whose next proposal does not depend on finished trials: the runner may ask ahead
# for them (service/runner/scheduler.py, `may_ask`).
HISTORY_FREE_SAMPLERS = ("random", "grid")


SpecError = InvalidField  # a spec problem, with the dotted field it concerns

# The largest magnitude of any integer in a definition: 2**53, the last integer a float (and
# a JavaScript client) holds exactly. The fields with bounds of their own stay far below it;
# the others (`eval_every`, `optim.warmup_steps`, a range's `high`, a choice, a fixed
# value, ...) met `float()` in the checks, and a 400-digit integer raised OverflowError: a
# 500 instead of a 422 (issue 42).
MAX_INT = 2**53


def _first_huge_int(node: Any, path: tuple[str, ...] = ()) -> tuple[tuple[str, ...], int] | None:
    """The path and value of the first integer (not a boolean) beyond +-MAX_INT in `node`."""
    if isinstance(node, int) and not isinstance(node, bool):
        return (path, node) if abs(node) > MAX_INT else None
    items: Any = ()
    if isinstance(node, dict):
        items = ((str(k), v) for k, v in node.items())
    elif isinstance(node, list | tuple):
        items = ((str(i), v) for i, v in enumerate(node))
    for key, child in items:
        if (hit := _first_huge_int(child, (*path, key))) is not None:
            return hit
    return None


def _check_integers(data: Any) -> None:
    hit = _first_huge_int(data)
    if hit is not None:
        path, value = hit
        raise SpecError(
            ".".join(path),
            f"an integer of {len(str(abs(value)))} digits is out of range: at most"
            f" {MAX_INT:,} (2**53) in magnitude",
        )


class StudySpec(_Strict):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.\-]*$")
    description: str = Field("", max_length=10_000)
    base: TrialConfig = Field(default_factory=TrialConfig)
    search_space: dict[str, Param] = Field(default_factory=dict, max_length=64)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    budget: Budget
    parallelism: int = Field(1, ge=1, le=256)
    objectives: list[Objective] = Field(
        default_factory=lambda: [Objective()], min_length=1, max_length=4
    )
    constraints: list[Constraint] = Field(default_factory=list, max_length=32)
    resources: Resources = Field(default_factory=Resources)
    max_retries: int = Field(2, ge=0, le=10)
    # Member slots per worker: trials trained together in one process as one fused model
    # (workers.fused), each in its own slot, a freed slot taking the next trial at once;
    # 1 turns fusion off (a Ray task per trial). Trials share a worker only with trials of
    # the same fusion key (shapes and loop). "auto" (the default): see `slots`.
    fuse: int | Literal["auto"] = "auto"
    # Whether a slot freed by a member that stopped takes the next trial at once (the
    # default). False runs fixed groups, as HFTA and ModelBatch do: once a member of a
    # worker's group has ended, the worker takes no new trial until the whole group has
    # ended. It exists to measure what refilling is worth (bench/slots.py --fixed-groups).
    refill: bool = True
    # A width ladder with bisection (StabilitySpec); null: none.
    stability: StabilitySpec | None = None

    @property
    def slots(self) -> int:
        """Member slots per worker: `fuse`, or what `fuse: auto` makes of this study.

        auto fuses where it pays: what `workers.fusion_plan.auto_fuse` says the base config
        gains (CPU: 4 below 0.25 GFLOP a step; GPU: 8, lowered by the worker's memory
        estimate; 1 where the fused model refuses the config), under every sampler. Samplers
        that learn from finished trials propose for the trials in flight (TPE's constant
        liar, GP's batch acquisition; CMA-ES and NSGA-II sample whole generations), and
        bench/archive/fuse_sampler.py measured TPE and GP at 1, 4 and 8 slots: no loss in the best
        feasible value after the same trials, and a better one at equal wall time (bench/
        README.md, "Fusion under learning samplers"). Each fusion key's workers then get
        what its own config gains (`service.runner.configs.slot_key`): a 12-layer grid point
        of a 1-layer base is not fused. Under samplers that learn, auto also ramps each
        worker up from one member as results arrive (`Scheduler.depth`).
        """
        if self.fuse != "auto":
            return self.fuse
        from workers.fusion_plan import auto_fuse  # torch-free

        return auto_fuse(self.base, self.resources.gpus)

    @field_validator("fuse", mode="before")
    @classmethod
    def _fuse_range(cls, v: object) -> object:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_FUSE:
            raise ValueError(f"must be an integer from 1 to {MAX_FUSE}, or 'auto'; got {v!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _input_integers_bounded(cls, data: Any) -> Any:
        """Every integer of the input within +-MAX_INT, named by its dotted field, before
        any field's own check reads it (the trial config's would name `base` only)."""
        _check_integers(data)
        return data

    @model_validator(mode="after")
    def _integers_bounded(self) -> StudySpec:
        """The same after validation (a string of digits in an integer field is an integer
        by then). Runs before `_consistent`, whose checks compute with the values."""
        _check_integers(self.model_dump(by_alias=True))
        return self

    @model_validator(mode="after")
    def _consistent(self) -> StudySpec:
        if self.base.device == "cuda" and self.resources.gpus == 0:
            raise SpecError(
                "resources.gpus",
                "base.device is cuda but the trials ask for no GPU: set resources.gpus (e.g. 1,"
                " or 0.25 to share one) or device auto",
            )
        if self.fuse != "auto" and self.fuse > 1:
            # The workers' own check; imported here only.
            from workers.fusion_plan import FusionError, check_fusable

            try:
                check_fusable(self.base)
            except FusionError as e:
                raise SpecError("fuse", f"fuse > 1 with this base config: {e}") from None
        if len(self.objectives) > 1 and self.pruner.kind != "none":
            raise SpecError("pruner.kind", "pruning needs a single objective: set it to none")
        if self.pruner.kind != "none" and self.objectives[0].metric not in INTERMEDIATE_SUMMARIES:
            raise SpecError(
                "objectives.0.metric",
                f"{self.objectives[0].metric} has no intermediate value to prune on; "
                "set pruner.kind to none",
            )
        if self.sampler.kind == "grid":
            for path, p in self.search_space.items():
                if isinstance(p, FloatParam | IntParam) and p.grid is None:
                    raise SpecError(f"search_space.{path}", "the grid sampler needs a 'grid' list")
        if self.stability is not None:
            self._check_stability(self.stability)
        for path, param in self.search_space.items():
            for value in extremes(param):
                try:
                    apply_params(self.base, {path: value})
                except SpecError as e:
                    raise SpecError(f"search_space.{path}", e.message) from None
        return self

    def _check_stability(self, st: StabilitySpec) -> None:
        """What a ladder needs, each failure naming its field."""
        space = self.search_space
        width = st.width or next((w for w in WIDTH_PARAMS if w in space), None)
        if width is None or width not in space or isinstance(space[width], FixedParam):
            raise SpecError(
                "stability.width",
                f"{width or ' or '.join(WIDTH_PARAMS)} is not searched: a ladder runs over "
                "widths (name the width parameter in stability.width)",
            )
        values = extremes(space[width])
        if isinstance(space[width], CategoricalParam | FloatParam | IntParam) and (
            len(set(map(repr, values))) < 2
        ):
            raise SpecError("stability.width", f"{width} takes one value: a ladder needs two")
        lr = space.get("optim.lr")
        if lr is None or isinstance(lr, FixedParam):
            raise SpecError("search_space.optim.lr", "a ladder searches optim.lr")
        if not self.base.eval_at_init and "eval_at_init" not in space:
            raise SpecError(
                "base.eval_at_init",
                "a ladder needs the step-0 validation loss l_0 for its tau rule: set it true",
            )
        named = {c.metric for c in self.constraints}
        for i, m in enumerate(st.instability_constraints):
            if m not in named:
                raise SpecError(
                    f"stability.instability_constraints.{i}",
                    f"{m} is not the metric of one of the study's constraints "
                    f"({', '.join(sorted(named)) or 'it has none'})",
                )
        if st.bisect_factor is not None:
            if self.sampler.kind != "grid":
                raise SpecError(
                    "stability.bisect_factor",
                    "bisection runs after the grid: set sampler.kind to grid (or "
                    "bisect_factor to null)",
                )
            if not isinstance(lr, FloatParam) or not lr.log:
                raise SpecError(
                    "search_space.optim.lr",
                    "bisection proposes learning rates between grid points: optim.lr must be "
                    "a float with log: true and a grid",
                )

    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    def content_hash(self) -> str:
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def extremes(param: Param) -> list[Scalar]:
    """The values a parameter's own check tries: its ends and grid, or every choice."""
    if isinstance(param, FloatParam | IntParam):
        return [param.low, param.high, *(param.grid or [])]
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    return [param.value]


def with_params(data: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dumped config `data` with dotted fields replaced (only the sections on
    the paths are copied: `data` is left as it was); raises SpecError naming a bad path."""
    out = dict(data)
    for path, value in params.items():
        node = out
        keys = path.split(".")
        for key in keys[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                raise SpecError(path, f"'{key}' is not a section of the trial config")
            copy = dict(child)
            node[key] = copy
            node = copy
        # model.hf.config / model.plugin.config are a model's own config: a key it leaves at
        # its default is searchable too (hf_config_errors names a key a family does not know)
        own_config = keys[:-1] in (["model", "hf", "config"], ["model", "plugin", "config"])
        if keys[-1] not in node and not own_config:
            raise SpecError(path, f"'{keys[-1]}' is not a field of the trial config")
        node[keys[-1]] = value
    return out


def apply_params(base: TrialConfig, params: dict[str, Any]) -> TrialConfig:
    """The base config with dotted fields replaced; raises SpecError naming a bad field."""
    data = with_params(base.model_dump(mode="json", by_alias=True), params)
    try:
        return TrialConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise SpecError(".".join(str(x) for x in err["loc"]) or "base", err["msg"]) from None


def resolve_task(task: TaskConfig, data_dir: str | None) -> TaskConfig:
    """The task as a worker opens it: a relative `data_dir` under the service's data
    directory (QKSCOPE_DATA_DIR), and that directory as the root the data must stay inside
    (`task.data_root`, checked again where the files are opened)."""
    if task.data_dir and not Path(task.data_dir).is_absolute() and data_dir:
        task = task.model_copy(update={"data_dir": str(Path(data_dir) / task.data_dir)})
    return task.model_copy(update={"data_root": data_dir or None})


def vocab_size(config: TrialConfig) -> int:
    """Tokens of the model's vocabulary: for lm the size the config fixes (`task.vocab_size`
    of bin, bpe and file; 256 for bytes) or, for word and char, the corpus's cap plus
    <unk>/<eos>; else the synthetic task's symbols and its markers."""
    task = config.task
    if task.kind != "lm":
        return 4 * task.n_symbols + 4
    fixed = task.fixed_vocab_size
    return task.vocab_cap + 2 if fixed is None else fixed


def count_params(config: TrialConfig, vocab: int) -> int:
    """About how many parameters a trial's model has (attention, MLP, embeddings)."""
    m = config.model.sizes()
    # the built-in count has always taken 2 MLP matrices (SwiGLU too): kept, so limits hold
    mats = m.mlp_matrices if config.model.kind == "hf" else min(m.mlp_matrices, 2)
    per_layer = 4 * m.d_model * m.d_model + mats * m.d_model * m.d_ff
    return m.n_layers * per_layer + vocab * m.d_model + config.task.seq_len * m.d_model


def summary_value(summary: TrialSummary | dict[str, Any], metric: str) -> float | None:
    data = summary.model_dump() if isinstance(summary, TrialSummary) else summary
    v = data.get(metric)
    return None if v is None else float(v)
