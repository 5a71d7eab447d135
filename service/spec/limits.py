"""What one accepted study definition may cost the head, a worker or the database.

The spec's own bounds (service/spec/__init__.py, workers/config.py) keep each field in a sane range,
and `service/spec/space.py` bounds a worker's memory. Fields that are harmless alone can still
multiply into something no deployment holds; each check here bounds one such product at
the largest point of the search space, against a setting (`QKSCOPE_MAX_*`), and answers
with a `SpecError` naming the field to change and the limit:

- the grid sampler's product (`grid_points`): Optuna's `GridSampler` builds every point as
  a list while the runner starts (three 1000-value grids: 1e9 points, about 68 GiB);
- evaluations per trial (`evaluations`): steps / eval_every; each one is an inbox message,
  an Optuna intermediate value and the metric rows below;
- metric rows per trial and per study (`metric_rows_per_evaluation`): evaluations x the
  registry's series (per layer, per head, none); `eval_every: 1` with 1e6 steps is about
  3.5e7 rows per trial;
- checkpoint bytes a trial writes (`checkpoint_bytes`): a checkpoint per `every_evals`
  evaluations, each the weights and the optimizer state;
- the bytes Optuna stores for a study's parameters (`param_bytes_per_trial`): each trial's
  row of each searched field holds that field's whole distribution as JSON, a categorical's
  every choice included (64 fields of 1000 choices over 10,000 trials: gigabytes);
- the characters of any one string (a categorical choice is stored in Optuna's tables with
  every trial that suggests it).

Every estimate errs high: the largest point of the space takes every field's worst value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from service.spec.model import SpecError, StudySpec, count_params, vocab_size
from service.spec.space import candidate_values, worst_points
from workers.metric_names import series_by_index

__all__ = [
    "Limits",
    "check_checkpoints",
    "check_evaluations",
    "check_grid",
    "check_param_bytes",
    "check_strings",
    "checkpoint_bytes",
    "evaluations",
    "grid_points",
    "metric_rows_per_evaluation",
    "param_bytes_per_trial",
]


class Limits:
    """The limits these checks apply (None: not checked); see service/config.py."""

    def __init__(
        self,
        *,
        grid_points: int | None = None,
        evals_per_trial: int | None = None,
        metric_rows_per_trial: int | None = None,
        metric_rows_per_study: int | None = None,
        checkpoint_bytes_per_trial: int | None = None,
        param_bytes_per_study: int | None = None,
        string_chars: int | None = None,
    ) -> None:
        self.grid_points = grid_points
        self.evals_per_trial = evals_per_trial
        self.metric_rows_per_trial = metric_rows_per_trial
        self.metric_rows_per_study = metric_rows_per_study
        self.checkpoint_bytes_per_trial = checkpoint_bytes_per_trial
        self.param_bytes_per_study = param_bytes_per_study
        self.string_chars = string_chars

    def check(self, spec: StudySpec) -> list[SpecError]:
        """Every limit this holds, in the order of the module docstring."""
        errors: list[SpecError] = []
        if self.grid_points is not None:
            errors += check_grid(spec, self.grid_points)
        errors += check_evaluations(
            spec, self.evals_per_trial, self.metric_rows_per_trial, self.metric_rows_per_study
        )
        if self.checkpoint_bytes_per_trial is not None:
            errors += check_checkpoints(spec, self.checkpoint_bytes_per_trial)
        if self.param_bytes_per_study is not None:
            errors += check_param_bytes(spec, self.param_bytes_per_study)
        if self.string_chars is not None:
            errors += check_strings(spec, self.string_chars)
        return errors


# ---- the grid -------------------------------------------------------------------------------


def grid_sizes(spec: StudySpec) -> dict[str, int]:
    """Values each searched field has on the grid sampler's grid (fixed fields: 1)."""
    sizes: dict[str, int] = {}
    for path, p in spec.search_space.items():
        if p.type == "categorical":
            sizes[path] = len(p.choices)
        elif p.type in ("float", "int"):
            sizes[path] = len(p.grid or ())
        else:
            sizes[path] = 1
    return sizes


def grid_points(spec: StudySpec) -> int:
    """The points of the grid Optuna's GridSampler builds (1 for an empty space)."""
    return math.prod(grid_sizes(spec).values())


def check_grid(spec: StudySpec, limit: int) -> list[SpecError]:
    """Under the grid sampler, its product against `limit` (QKSCOPE_MAX_GRID_POINTS); names
    the field with the most values."""
    if spec.sampler.kind != "grid" or not spec.search_space:
        return []
    sizes = grid_sizes(spec)
    n = math.prod(sizes.values())
    if n <= limit:
        return []
    largest = max(sizes, key=lambda p: sizes[p])
    product = " x ".join(f"{v:,}" for v in sorted(sizes.values(), reverse=True) if v > 1)
    return [
        SpecError(
            f"search_space.{largest}",
            f"the grid has {n:,} points ({product}) > limit {limit:,} (QKSCOPE_MAX_GRID_POINTS);"
            f" the grid sampler builds every point when the study starts: use fewer values or"
            f" a sampler that does not enumerate (random, tpe)",
        )
    ]


# ---- evaluations and metric rows ------------------------------------------------------------


def _values(spec: StudySpec, path: str, base: Any) -> list[Any]:
    """Every value the study can give `path` (its base value when not searched); numbers
    only where they can be read as numbers (pydantic's lax mode reads "100" as 100)."""
    p = spec.search_space.get(path)
    if p is None:
        return [base]
    return list(candidate_values(p, spec.sampler.kind == "grid")[0])


def _ints(values: list[Any]) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool):
            continue
        try:
            out.append(int(float(v)))
        except (TypeError, ValueError):
            continue
    return out


def _field(spec: StudySpec, path: str) -> str:
    return f"search_space.{path}" if path in spec.search_space else f"base.{path}"


def evaluations(spec: StudySpec) -> int:
    """The most evaluations one trial of the study runs: its largest `steps` over its
    smallest `eval_every` (rounded up: the last step is evaluated too), plus the untrained
    model's with `eval_at_init`."""
    steps = max(_ints(_values(spec, "steps", spec.base.steps)), default=spec.base.steps)
    every = max(1, min(_ints(_values(spec, "eval_every", spec.base.eval_every)), default=1))
    init = any(v is True for v in _values(spec, "eval_at_init", spec.base.eval_at_init))
    return math.ceil(steps / every) + int(init)


def metric_rows_per_evaluation(n_layers: int, n_heads: int) -> int:
    """Metric rows one evaluation writes, from the metric registry (workers/metric_names.py):
    each series without an index once, per layer ones for layers 0..L, per head ones for
    every head of every layer. An upper bound (some series only exist for some tasks or
    regularizers)."""
    none, layer, head = (len(series_by_index(i)) for i in ("none", "layer", "head"))
    return none + layer * (n_layers + 1) + head * n_layers * n_heads


def _layers_heads(spec: StudySpec) -> tuple[int, int]:
    m = spec.base.model
    if m.kind == "hf" and m.hf is not None:  # the family's own keys, searched or not
        from workers.hf_families import HF_FAMILIES

        family, z = HF_FAMILIES[m.hf.model_type], m.sizes()
        layer_path, head_path = (
            f"model.hf.config.{family.layers}",
            f"model.hf.config.{family.heads}",
        )
        layers = max(_ints(_values(spec, layer_path, z.n_layers)), default=z.n_layers)
        heads = max(_ints(_values(spec, head_path, z.n_heads)), default=z.n_heads)
        return layers, heads
    layers = max(_ints(_values(spec, "model.n_layers", m.n_layers)), default=m.n_layers)
    heads = max(_ints(_values(spec, "model.n_heads", m.n_heads)), default=m.n_heads)
    return layers, heads


def check_evaluations(
    spec: StudySpec,
    max_evals: int | None,
    max_rows_trial: int | None,
    max_rows_study: int | None,
) -> list[SpecError]:
    """Evaluations per trial (QKSCOPE_MAX_EVALS_PER_TRIAL), metric rows per trial
    (QKSCOPE_MAX_METRIC_ROWS_PER_TRIAL) and per study (QKSCOPE_MAX_METRIC_ROWS_PER_STUDY) at
    the largest point; the first two name `eval_every` (the knob that costs no science), the
    last `budget.n_trials`."""
    errors: list[SpecError] = []
    evals = evaluations(spec)
    every = _field(spec, "eval_every")
    if max_evals is not None and evals > max_evals:
        errors.append(
            SpecError(
                every,
                f"{evals:,} evaluations per trial (steps / eval_every) > limit {max_evals:,}"
                f" (QKSCOPE_MAX_EVALS_PER_TRIAL): raise eval_every",
            )
        )
    layers, heads = _layers_heads(spec)
    per_eval = metric_rows_per_evaluation(layers, heads)
    rows = evals * per_eval
    shape = f"{evals:,} evaluations x {per_eval:,} rows ({layers} layers, {heads} heads)"
    if max_rows_trial is not None and rows > max_rows_trial:
        errors.append(
            SpecError(
                every,
                f"about {rows:,} metric rows per trial ({shape}) > limit {max_rows_trial:,}"
                f" (QKSCOPE_MAX_METRIC_ROWS_PER_TRIAL): raise eval_every",
            )
        )
    total = rows * spec.budget.n_trials
    if max_rows_study is not None and total > max_rows_study:
        errors.append(
            SpecError(
                "budget.n_trials",
                f"about {total:,} metric rows for the study ({spec.budget.n_trials:,} trials of"
                f" {shape}) > limit {max_rows_study:,} (QKSCOPE_MAX_METRIC_ROWS_PER_STUDY):"
                f" fewer trials or a larger eval_every",
            )
        )
    return errors


# ---- checkpoints ----------------------------------------------------------------------------


def checkpoint_bytes(n_params: int, dtype: str, optimizer: str) -> int:
    """Bytes of one checkpoint: the weights and the optimizer's state (AdamW: two moments;
    SGD: none), 8 bytes a number in float64, else 4 (float32 master weights)."""
    width = 8 if dtype == "float64" else 4
    copies = 3 if optimizer == "adamw" else 1
    return n_params * width * copies


def check_checkpoints(spec: StudySpec, limit: int) -> list[SpecError]:
    """Bytes one trial writes to checkpoint storage over its life (one checkpoint every
    `checkpoint.every_evals` evaluations, each replacing the last) against `limit`
    (QKSCOPE_MAX_CHECKPOINT_BYTES_PER_TRIAL): a 200M-parameter model checkpointed at every
    evaluation writes 2.4 GB each time. Names `checkpoint.every_evals`."""
    evals = evaluations(spec)
    base_every = spec.base.checkpoint.every_evals
    every = max(1, min(_ints(_values(spec, "checkpoint.every_evals", base_every)), default=1))
    writes = math.ceil(evals / every)
    dtypes = {str(v) for v in _values(spec, "dtype", spec.base.dtype)}
    optims = {str(v) for v in _values(spec, "optim.name", spec.base.optim.name)}
    size = 0
    for _, big in worst_points(spec):
        n = count_params(big, vocab_size(big))
        size = max(size, *(checkpoint_bytes(n, d, o) for d in dtypes for o in optims))
    total = writes * size
    if total <= limit:
        return []
    return [
        SpecError(
            _field(spec, "checkpoint.every_evals"),
            f"about {total / 2**30:,.1f} GiB of checkpoints written per trial ({writes:,}"
            f" checkpoints of {size / 2**20:,.0f} MiB) > limit {limit / 2**30:,.1f} GiB"
            f" (QKSCOPE_MAX_CHECKPOINT_BYTES_PER_TRIAL): raise checkpoint.every_evals",
        )
    ]


# ---- Optuna's parameter rows ----------------------------------------------------------------


def param_bytes_per_trial(spec: StudySpec) -> dict[str, int]:
    """Bytes of the distribution Optuna stores with each trial, per searched field: its
    `distribution_json` (a fixed field is not asked of Optuna, so it stores nothing)."""
    import optuna

    out: dict[str, int] = {}
    for path, p in spec.search_space.items():
        dist: optuna.distributions.BaseDistribution
        if p.type == "categorical":
            dist = optuna.distributions.CategoricalDistribution(p.choices)
        elif p.type == "float":
            dist = optuna.distributions.FloatDistribution(p.low, p.high, log=p.log)
        elif p.type == "int":
            dist = optuna.distributions.IntDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            continue
        out[path] = len(optuna.distributions.distribution_to_json(dist).encode())
    return out


def check_param_bytes(spec: StudySpec, limit: int) -> list[SpecError]:
    """Optuna's parameter rows for the whole study (`budget.n_trials` x each trial's
    distributions) against `limit` (QKSCOPE_MAX_PARAM_BYTES_PER_STUDY); names the field with
    the largest distribution."""
    sizes = param_bytes_per_trial(spec)
    total = sum(sizes.values()) * spec.budget.n_trials
    if total <= limit:
        return []
    largest = max(sizes, key=lambda p: sizes[p])
    return [
        SpecError(
            f"search_space.{largest}",
            f"about {total / 2**20:,.0f} MiB of parameter rows in Optuna's tables"
            f" ({spec.budget.n_trials:,} trials x {sum(sizes.values()):,} bytes; this field"
            f" {sizes[largest]:,}) > limit {limit / 2**20:,.0f} MiB"
            f" (QKSCOPE_MAX_PARAM_BYTES_PER_STUDY): fewer or shorter choices, or fewer trials",
        )
    ]


# ---- strings --------------------------------------------------------------------------------

# Free text with a bound of its own (StudySpec.description: 10,000 characters).
_OWN_BOUND = {("description",)}


def _strings(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, (*path, str(k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, (*path, str(i)))


def check_strings(spec: StudySpec, limit: int) -> list[SpecError]:
    """No string of the definition (a categorical choice, a fixed value, a data directory,
    a split's name) longer than `limit` characters (QKSCOPE_MAX_STRING_CHARS), except the
    description, which has its own bound. Names the first such field."""
    data = spec.model_dump(mode="json", by_alias=True)
    for path, s in _strings(data):
        if path in _OWN_BOUND or len(s) <= limit:
            continue
        return [
            SpecError(
                ".".join(path),
                f"{len(s):,} characters > limit {limit:,} (QKSCOPE_MAX_STRING_CHARS)",
            )
        ]
    return []
