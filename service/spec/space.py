"""Every point a study's search space can suggest, checked before the study is stored.

`StudySpec` checks each parameter's endpoints alone. That misses the points in between
(`model.n_heads: {type: int, low: 1, high: 8}` on d_model 32: 3, 5, 6 and 7 do not divide
it) and fields that are only valid together (`optim.warmup_steps` against `steps`, both
searched), and at run time the suggest of such a point raised and failed the whole study.
`check_search_space` enumerates instead:

- each parameter's values, all of them where the space is finite and small (categorical
  choices, grids, int ranges up to `ENUM_MAX` values), else its endpoints, the top of its
  step grid, an even spread and two fractional interior points (a float range over an int
  field fails inside, not at its ends);
- the combinations of the fields the trial config checks together (`INTERACTING`): the
  full product where it is small, else every pair of them and a thinned product that keeps
  each field's extremes (the interval rules, such as warmup <= steps, fail at the extremes).

The first failing point is a `SpecError` naming `search_space.<path>` and the value (for a
combination, every value of it). Work is bounded (`MAX_POINT_CHECKS`, `MAX_COMBO_CHECKS`,
about a second at most), so a huge space is checked on a sample, not refused; the runner
fails a trial whose suggest still fails, not the study.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from service.spec.model import (
    CategoricalParam,
    FixedParam,
    FloatParam,
    IntParam,
    Param,
    Scalar,
    SpecError,
    StudySpec,
    with_params,
)
from workers.config import BLOCK_PRESETS, ModelConfig, TaskConfig, TrialConfig

__all__ = [
    "ENUM_MAX",
    "INTERACTING",
    "MAX_COMBO_CHECKS",
    "MAX_POINT_CHECKS",
    "candidate_values",
    "check_memory",
    "check_search_space",
    "unchecked_config",
    "worst_points",
]

# An int range of at most this many values is enumerated; a larger one is sampled.
ENUM_MAX = 4096
# Values of one sampled range (besides its ends): an even spread.
SPREAD = 64
# Trial configs validated for single parameters, and for combinations, per spec (~20 us each).
MAX_POINT_CHECKS = 40_000
MAX_COMBO_CHECKS = 40_000
# Fields the trial config (workers/config.py) validates together, one group per validator:
# ModelConfig._heads_divide_width, TrialConfig._warmup_fits, TaskConfig._check_layout,
# TrialConfig._mask_hides_the_targets, and an hf model's shapes.
_HF = "model.hf.config."
INTERACTING: tuple[tuple[str, ...], ...] = (
    ("model.d_model", "model.n_heads"),
    # HFModelSpec (workers/hf_families.py, hf_config_errors) and TrialConfig._hf_positions_fit
    (
        "model.hf.model_type",
        *(_HF + k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")),
        *(_HF + k for k in ("head_dim", "n_embd", "n_head")),
    ),
    ("task.seq_len", _HF + "max_position_embeddings", _HF + "n_positions"),
    ("steps", "optim.warmup_steps"),
    ("task.kind", "model.causal"),
    (
        "task.kind",
        "task.data_dir",
        "task.train_split",
        "task.valid_split",
        "task.format",
        "task.tokenizer",
        "task.vocab_size",
        "task.token_dtype",
        "task.n_pairs",
        "task.n_symbols",
        "task.seq_len",
    ),
)
# Interior points of a float range, as fractions of it (linear, or of its logarithm).
_PROBES = (0.381966, 0.5)


def candidate_values(param: Param, grid_sampler: bool) -> tuple[list[Scalar], bool]:
    """The values the study's sampler can suggest for `param`, and whether that list is all
    of them (the grid sampler suggests only grid values and choices; other samplers the
    whole range: Optuna's int range is low, low + step, ... up to high, rounded down)."""
    if isinstance(param, FixedParam):
        return [param.value], True
    if isinstance(param, CategoricalParam):
        return list(param.choices), True
    if grid_sampler and param.grid is not None:
        return list(param.grid), True
    if isinstance(param, IntParam):
        top = param.low + (param.high - param.low) // param.step * param.step
        n = (top - param.low) // param.step + 1
        extra: list[Scalar] = list(param.grid or [])
        if n <= ENUM_MAX:
            return [*range(param.low, top + 1, param.step), *extra], True
        picks = {param.low + (n - 1) * i // SPREAD * param.step for i in range(SPREAD + 1)}
        return [*sorted(picks | {top}), *extra], False
    return [*_float_points(param), *(param.grid or [])], False


def _float_points(p: FloatParam) -> list[Scalar]:
    if p.log:
        lo, hi = math.log(p.low), math.log(p.high)
        inner = [math.exp(lo + (hi - lo) * f) for f in _PROBES]
    else:
        inner = [p.low + (p.high - p.low) * f for f in _PROBES]
    return [p.low, *inner, p.high]


def _thin(values: Sequence[Scalar], k: int) -> list[Scalar]:
    """At most `k` (>= 2) of `values`: for numbers the smallest, the largest and an even
    spread between them; otherwise the first k."""
    if len(values) <= k:
        return list(values)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        ordered = sorted(values, key=float)
        idx = {round(i * (len(ordered) - 1) / (k - 1)) for i in range(k)}
        return [ordered[i] for i in sorted(idx)]
    return list(values[:k])


class _Checker:
    """Validates trial configs made from the base config and some parameter values."""

    def __init__(self, base: TrialConfig) -> None:
        self.data = base.model_dump(mode="json", by_alias=True)
        self.checks = 0

    def error(self, params: dict[str, Scalar]) -> str | None:
        self.checks += 1
        try:
            TrialConfig.model_validate(with_params(self.data, params))
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            return f"{loc}: {msg}" if loc else msg
        except SpecError as e:  # a path that is not a field: the endpoint check names it first
            return e.message
        return None


def _show(params: dict[str, Scalar]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())


def _budget(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Values to check per path so that their sum stays within `total`: the largest
    enumerations are thinned first (never below 2 values: the extremes)."""
    keep = dict(sizes)
    while sum(keep.values()) > total:
        path = max(keep, key=lambda p: keep[p])
        if keep[path] <= 2:
            break
        keep[path] = max(2, keep[path] // 2)
    return keep


def check_search_space(spec: StudySpec) -> None:
    """Raise SpecError at the first point of the search space that is not a valid trial
    config (or that Optuna would refuse): `search_space.<path>` and the failing value."""
    grid = spec.sampler.kind == "grid"
    values = {p: candidate_values(param, grid)[0] for p, param in spec.search_space.items()}
    checker = _Checker(spec.base)
    keep = _budget({p: len(v) for p, v in values.items()}, MAX_POINT_CHECKS)
    for path, vals in values.items():
        for v in _thin(vals, keep[path]):
            if (msg := checker.error({path: v})) is not None:
                raise SpecError(f"search_space.{path}", f"{msg} (at {path}={v!r})")
    groups = [[p for p in g if p in values] for g in INTERACTING]
    groups = [g for g in groups if len(g) >= 2]
    for group in groups:
        share = MAX_COMBO_CHECKS // len(groups)
        _check_group(checker, group, values, share)


def _check_group(
    checker: _Checker, group: list[str], values: dict[str, list[Scalar]], share: int
) -> None:
    full = math.prod(len(values[p]) for p in group)
    if full <= share:
        _check_product(checker, group, [values[p] for p in group])
        return
    pairs = list(itertools.combinations(group, 2))
    per_pair = share // 2 // len(pairs)
    for a, b in pairs:
        k = max(2, math.isqrt(max(4, per_pair)))
        _check_product(checker, [a, b], [_thin(values[a], k), _thin(values[b], k)])
    k = max(2, int((share // 2) ** (1 / len(group))))
    _check_product(checker, group, [_thin(values[p], k) for p in group])


def _check_product(checker: _Checker, paths: list[str], lists: Iterable[list[Scalar]]) -> None:
    for combo in itertools.product(*lists):
        params = dict(zip(paths, combo, strict=True))
        if (msg := checker.error(params)) is not None:
            raise SpecError(f"search_space.{_blame(paths, msg)}", f"{msg} (at {_show(params)})")


def _blame(paths: list[str], msg: str) -> str:
    """The path of a failing combination to name: the one the error's location names,
    else the last (for d_model/n_heads: n_heads)."""
    loc = msg.partition(":")[0]
    return next((p for p in paths if p == loc), paths[-1])


# ---- the largest points, for the memory and size limits -------------------------------------

# Numeric fields that grow a trial's memory: at their largest value in the worst point.
GROWING: tuple[str, ...] = (
    "batch_size",
    "probe_batch_size",
    "model.n_layers",
    "model.n_heads",
    "model.d_model",
    "model.d_ff",
    "task.seq_len",
    "task.vocab_cap",
    "task.vocab_size",
    "task.n_symbols",
    "task.n_valid",
)
# Fields whose choices change the shape of the estimate: every combination is a worst point.
# Each has a handful of valid values (a Literal or a bool; `dtype` sets bytes per number), so
# once each field's values are validated and made distinct there are at most
# 4 x 3 x 5 x 2 x 6 x 4 combinations, whatever the choices say: the product is never built
# from the choices themselves (1,000 copies of one choice in each of three fields was 1e9
# points, issue 42).
CHOOSING: tuple[str, ...] = (
    "task.kind",
    "task.format",
    "task.tokenizer",
    "model.mlp",
    "model.block",
    "dtype",
)


@functools.cache
def _adapter(path: str) -> TypeAdapter[Any]:
    """A validator of one field of the trial config, with the field's own annotation."""
    if path.startswith(("model.hf.config.", "model.plugin.config.")):  # a model's own key
        from workers.config_sections import HFValue

        return TypeAdapter(HFValue)
    model: type[BaseModel] = TrialConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    field = model.model_fields[name]
    kind: Any = field.annotation
    if field.metadata:
        kind = Annotated[kind, *field.metadata]
    return TypeAdapter(kind)


def _distinct_valid(path: str, values: list[Scalar]) -> list[Scalar]:
    """The distinct values `values` give the field `path`, as the trial config reads them
    (pydantic's lax mode reads "true", 1 and "on" as one True); values the field refuses are
    left out (the point checks name them, or the runner fails the trial that draws one)."""
    adapter = _adapter(path)
    out: dict[Any, None] = {}
    for v in values:
        try:
            out[adapter.validate_python(v)] = None
        except ValidationError:
            continue
    return list(out)


def _number(v: Scalar) -> float | None:
    """A value as a number (pydantic's lax mode reads "128" as 128), or None."""
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except ValueError:
        return None


def _extreme(values: list[Scalar], largest: bool) -> int | None:
    numbers = [n for n in map(_number, values) if n is not None]
    if not numbers:
        return None
    return int(max(numbers) if largest else min(numbers))


def unchecked_config(data: dict[str, Any]) -> TrialConfig:
    """A trial config from a dumped one, not validated: the largest values of every field
    together need not be a valid config, and still bound the memory of every point that is.
    Numbers are coerced to int where the estimate reads them; a block preset sets `mlp`."""
    model = dict(data["model"])
    if model.get("block", "custom") in BLOCK_PRESETS:
        model["mlp"] = BLOCK_PRESETS[model["block"]][1]
    task = dict(data["task"])
    top = dict(data)
    for section, path in ((top, "batch_size"), (top, "probe_batch_size")):
        section[path] = int(float(section[path]))
    if model.get("d_ff_ratio") is not None:  # the width rule, as ModelConfig applies it
        model["d_ff"] = max(4, round(float(model["d_ff_ratio"]) * float(model["d_model"])))
    if model.get("head_dim"):
        model["n_heads"] = max(1, int(float(model["d_model"])) // int(float(model["head_dim"])))
    for key in ("n_layers", "n_heads", "d_model", "d_ff"):
        model[key] = max(1, int(float(model[key])))
    for key in ("seq_len", "vocab_cap", "n_symbols", "n_valid"):
        task[key] = int(float(task[key]))
    if task.get("vocab_size") is not None:
        task["vocab_size"] = int(float(task["vocab_size"]))
    return TrialConfig.model_construct(
        **{
            **top,
            "model": ModelConfig.model_construct(**model),
            "task": TaskConfig.model_construct(**task),
        }
    )


def worst_points(spec: StudySpec) -> list[tuple[dict[str, Scalar], TrialConfig]]:
    """The points of the search space that need the most memory (and parameters): every
    growing field at its largest value, for each combination of the choosing fields' distinct
    valid values (at most 2,880); with the values set, as trial configs (`unchecked_config`)."""
    grid = spec.sampler.kind == "grid"
    values = {p: candidate_values(param, grid)[0] for p, param in spec.search_space.items()}
    largest: dict[str, Scalar] = {}
    for path in GROWING:
        if path in values and (top := _extreme(values[path], largest=True)) is not None:
            largest[path] = top
    choices = {p: _distinct_valid(p, values[p]) for p in CHOOSING if p in values}
    choosing = [p for p, v in choices.items() if v]  # none valid: the base value stands
    data = spec.base.model_dump(mode="json", by_alias=True)
    points = []
    for combo in itertools.product(*(choices[p] for p in choosing)):
        params = {**largest, **dict(zip(choosing, combo, strict=True))}
        points.append((params, unchecked_config(with_params(data, params))))
    return points


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**28 else f"{n / 2**20:.0f} MiB"


def _members(spec: StudySpec, config: TrialConfig) -> int:
    """How many members of `config` one worker of the study holds at once. A GPU worker
    lowers its slots to what its memory estimate fits (workers/remote.py): one must fit."""
    from workers.fusion_plan import FusionError, auto_fuse, check_fusable

    if spec.resources.gpus > 0:
        return 1
    try:
        check_fusable(config)
    except FusionError:
        return 1
    if spec.fuse != "auto":
        return spec.fuse
    return auto_fuse(config, 0.0)


def _part_field(part: str, config: TrialConfig) -> str:
    lm = config.task.kind == "lm"
    vocab = "task.vocab_cap" if config.task.fixed_vocab_size is None else "task.vocab_size"
    return {
        "parameters": "model",
        "activations": "batch_size",
        "logits": vocab if lm else "task.n_symbols",
        "probe": "probe_batch_size",
        "validation": "batch_size" if lm else "task.n_valid",
    }[part]


def check_memory(spec: StudySpec, max_bytes: int) -> list[SpecError]:
    """A 422 for a study whose worst point cannot fit one worker: `memory_estimate` of one
    member (parameters, activations, logits, probe, validation set) times the members its
    worker holds, against `max_bytes` (QKSCOPE_MAX_TRIAL_MEMORY_BYTES). Names `fuse` when
    one member fits, else the searched field whose smallest value saves the most, else the
    base field behind the largest part."""
    from workers.fusion_plan import memory_estimate

    grid = spec.sampler.kind == "grid"
    data = spec.base.model_dump(mode="json", by_alias=True)
    for params, config in worst_points(spec):
        est = memory_estimate(config)
        members = _members(spec, config)
        if est.total * members <= max_bytes:
            continue
        if members > 1 and est.total <= max_bytes:
            field = "fuse"
        else:
            field = f"base.{_part_field(est.largest(), config)}"
            saved = 0
            for path in params:
                if path not in GROWING:
                    continue
                param = spec.search_space[path]
                low = _extreme(candidate_values(param, grid)[0], largest=False)
                smaller = unchecked_config(with_params(data, {**params, path: low}))
                if (d := est.total - memory_estimate(smaller).total) > saved:
                    field, saved = f"search_space.{path}", d
            if params.get("dtype") == "float64":  # double precision doubles every float part
                single = unchecked_config(with_params(data, {**params, "dtype": "float32"}))
                if est.total - memory_estimate(single).total > saved:
                    field = "search_space.dtype"
        parts = ", ".join(
            f"{name} {_gib(getattr(est, name))}"
            for name in ("parameters", "activations", "logits", "probe", "validation")
        )
        where = f" at {_show(params)}" if params else ""
        each = f"{members} members of {_gib(est.total)} each" if members > 1 else "one member"
        return [
            SpecError(
                field,
                f"about {_gib(est.total * members)} for {each} ({parts}){where}: more than "
                f"a worker may use ({_gib(max_bytes)}, QKSCOPE_MAX_TRIAL_MEMORY_BYTES)",
            )
        ]
    return []
