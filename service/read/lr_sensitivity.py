"""Learning-rate sensitivity of a study (METRICS.md section 9, Wortsman et al. 2023), read
from its trials.

For one group of trials that differ only in `optim.lr` and seed, per seed:

- `l(eta)`: the final validation loss (`final_val_loss`) of the trial at learning rate `eta`;
  a trial that diverged counts as `l_0` (state DIVERGED, a summary that says it diverged, or
  a non-finite or missing final loss);
- `l_0`: the validation loss of the untrained model, the step-0 evaluation (`eval_at_init`):
  the `val_loss` metric row at step 0, else the summary's `init_val_loss`;
- `l* = min over eta of l(eta)`;
- `LR sensitivity = mean over the grid's eta of [min(l(eta), l_0) - l*]`.

The curve gives `l(eta)` as it is (median, quartiles, range over seeds) and the median and
range of `min(l(eta), l_0)` per seed (`clipped_*`, with how many seeds lay above their `l_0`):
the part of the curve the definition uses, which the web UI draws.

Per group: the mean over seeds with a Student-t interval (service/read/intervals.py, the
same helper the reproduction tables use), the curve `l(eta)` as median and spread over seeds
at each `eta`, and `l_0` (the mean of the seeds' step-0 losses).

Missing points are never filled in. A seed whose grid is not complete (a learning rate not
finished yet, failed, cancelled or pruned, or no step-0 evaluation) is left out of the
sensitivity and listed under `left_out` with the reason and the learning rates it lacks, so a
running study's number covers only the seeds it names. The curve uses every finished point
of the seeds that have an `l_0`, and says at each `eta` how many seeds it holds (`n`). A
PRUNED trial that did not diverge has no final loss (the pruner or a constraint stopped it
early), so it is a missing point, not `l_0`: an LR-sensitivity study should not prune (see
study_defs/lr_sensitivity.yaml).

Read-only: nothing here writes a row.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import InvalidField
from service.read.intervals import t_interval
from service.read.summaries import bounded_summary, decode_summary
from service.spec import SpecError, apply_params, resolve_task
from service.store import NO_INDEX, Metric, Study, Trial, TrialState
from workers.config import TrialConfig
from workers.unigram import unigram_floor

__all__ = [
    "CONFIDENCE",
    "LR_PARAM",
    "SEED_PARAM",
    "CurvePoint",
    "GroupResult",
    "LeftOut",
    "LrSensitivity",
    "LrSensitivityError",
    "SeedResult",
    "TrialPoint",
    "lr_sensitivity",
    "seed_sensitivity",
    "study_lr_sensitivity",
    "summarize_group",
    "with_floor",
]

LR_PARAM = "optim.lr"
SEED_PARAM = "seed"
CONFIDENCE = 0.95
# A grid counts as equally spaced in log(eta) when every step of log(eta) is within this
# fraction of their mean (1, 3, 10, 30, ... passes: steps log 3 and log 10/3, 9 % apart).
LOG_SPACING_TOLERANCE = 0.15
_RESULT_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED)


LrSensitivityError = InvalidField  # a request this study cannot answer, naming the field


# --- the computation on numbers ---------------------------------------------------------------


def lr_sensitivity(losses: Sequence[float], l0: float) -> float:
    """METRICS.md section 9 for one seed: `losses` is `l(eta)` at each learning rate of the
    grid (a diverged trial already replaced by `l0`), `l0` the untrained model's loss.

    `mean over eta of [min(l(eta), l0) - l*]`, `l* = min over eta of l(eta)`: 0 when every
    learning rate reaches the best loss, `l0 - l*` when only one does. (Negative only when no
    learning rate trains below `l0`, as the definition gives.)"""
    if not losses:
        raise ValueError("a grid of at least one learning rate is needed")
    best = min(losses)
    return math.fsum(min(v, l0) - best for v in losses) / len(losses)


@dataclass(frozen=True)
class TrialPoint:
    """One finished trial as the computation sees it."""

    seed: int
    lr: float
    loss: float | None  # the final validation loss; None (or non-finite) counts as diverged
    diverged: bool
    l0: float | None  # its step-0 validation loss


@dataclass(frozen=True)
class SeedResult:
    seed: int
    l0: float
    l_star: float
    sensitivity: float
    losses: list[float]  # l(eta) at each grid eta, a diverged trial as l0


@dataclass(frozen=True)
class LeftOut:
    """A seed left out of the sensitivity, and why."""

    seed: int
    reason: str
    missing_lrs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class CurvePoint:
    """`l(eta)` over the seeds at one learning rate (diverged trials counted as their l0),
    and the same statistics of `min(l(eta), l_0)` per seed (`clipped_*`): what the
    sensitivity uses, and what the web UI draws, so that a run that blew up to hundreds of
    nats without going non-finite does not set the plot's scale."""

    lr: float
    n: int  # seeds with a point here
    diverged: int  # of them, how many diverged
    median: float | None
    q25: float | None
    q75: float | None
    min: float | None
    max: float | None
    above_l0: int = 0  # of the n, finite final losses above their seed's l_0
    clipped_median: float | None = None  # of min(l, l_0) over the seeds
    clipped_min: float | None = None
    clipped_max: float | None = None


@dataclass(frozen=True)
class GroupResult:
    params: dict[str, Any]  # the group_by parameters' values
    n_seeds: int  # seeds in the sensitivity (complete grids)
    sensitivity: float | None  # mean over those seeds
    ci_low: float | None  # Student-t interval of that mean (None below 2 seeds)
    ci_high: float | None
    l0: float | None  # mean over seeds of the step-0 validation loss
    curve: list[CurvePoint]
    seeds: list[SeedResult]
    left_out: list[LeftOut]
    repeated: int = 0  # finished trials beyond the first of a (seed, eta): not used
    l_star: float | None = None  # mean over the sensitivity's seeds of their l*
    unigram_floor: float | None = None  # METRICS.md 9: the data's unigram cross-entropy
    note: str | None = None  # why the group says nothing about attention, or the floor is missing


@dataclass(frozen=True)
class LrSensitivity:
    study_id: int
    group_by: list[str]
    grid: list[float]
    log_spaced: bool
    confidence: float
    groups: list[GroupResult]


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    """(q25, median, q75), linear interpolation between order statistics."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q25, q50, q75 = statistics.quantiles(values, n=4, method="inclusive")
    return q25, q50, q75


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def seed_sensitivity(
    grid: Sequence[float], points: Mapping[float, TrialPoint], l0: float
) -> SeedResult | None:
    """One seed's result, or None when a grid point is missing from `points` (by eta)."""
    if any(eta not in points for eta in grid):
        return None
    seed = next(iter(points.values())).seed
    losses = [
        l0 if points[eta].diverged or not _finite(points[eta].loss) else float(points[eta].loss)  # type: ignore[arg-type]
        for eta in grid
    ]
    return SeedResult(seed, l0, min(losses), lr_sensitivity(losses, l0), losses)


def _missing_reason(missing: list[float], grid: Sequence[float], why: Mapping[float, str]) -> str:
    """`2 of 7 learning rates have no final loss: 0.1 RUNNING, 1 not started`."""
    parts = [f"{eta:g} {why.get(eta, 'not started')}" for eta in missing]
    return f"{len(missing)} of {len(grid)} learning rates have no final loss: {', '.join(parts)}"


def summarize_group(
    params: dict[str, Any],
    grid: Sequence[float],
    trials: Sequence[TrialPoint],
    unfinished: Mapping[int, Mapping[float, str]] | None = None,
) -> GroupResult:
    """A group's sensitivity (complete seeds), curve and l0 from its finished trials; each
    `TrialPoint.lr` must be a value of `grid`. The first point of a (seed, eta) is used.
    `unfinished`: seed -> eta -> why that point has no final loss (a state such as RUNNING,
    PRUNED, FAILED), for the reasons under `left_out`; seeds only there are left out too."""
    unfinished = unfinished or {}
    by_seed: dict[int, dict[float, TrialPoint]] = defaultdict(dict)
    repeated = 0
    for t in trials:
        if t.lr in by_seed[t.seed]:
            repeated += 1
            continue
        by_seed[t.seed][t.lr] = t
    seeds: list[SeedResult] = []
    left_out: list[LeftOut] = []
    l0_of: dict[int, float] = {}
    for seed in sorted(set(by_seed) | set(unfinished)):
        pts = by_seed.get(seed, {})
        why = unfinished.get(seed, {})
        if not pts:
            left_out.append(LeftOut(seed, _missing_reason(list(grid), grid, why), list(grid)))
            continue
        inits = [p.l0 for p in pts.values() if p.l0 is not None and math.isfinite(p.l0)]
        if not inits:
            left_out.append(
                LeftOut(seed, "no step-0 evaluation (eval_at_init): l_0 is unknown", [])
            )
            continue
        l0_of[seed] = math.fsum(inits) / len(inits)  # equal: the same seed, the same init
        result = seed_sensitivity(grid, pts, l0_of[seed])
        if result is None:
            missing = [eta for eta in grid if eta not in pts]
            left_out.append(LeftOut(seed, _missing_reason(missing, grid, why), missing))
            continue
        seeds.append(result)
    curve = []
    for eta in grid:
        vals = []
        clipped = []
        n_div = 0
        for seed, l0 in l0_of.items():
            p = by_seed[seed].get(eta)
            if p is None:
                continue
            bad = p.diverged or not _finite(p.loss)
            n_div += bad
            vals.append(l0 if bad else float(p.loss))  # type: ignore[arg-type]
            clipped.append(min(vals[-1], l0))
        if vals:
            q25, med, q75 = _quantiles(sorted(vals))
            above = sum(c < v for c, v in zip(clipped, vals, strict=True))
            curve.append(
                CurvePoint(
                    eta,
                    len(vals),
                    n_div,
                    med,
                    q25,
                    q75,
                    min(vals),
                    max(vals),
                    above,
                    _quantiles(sorted(clipped))[1],
                    min(clipped),
                    max(clipped),
                )
            )
        else:
            curve.append(CurvePoint(eta, 0, 0, None, None, None, None, None))
    sens = [s.sensitivity for s in seeds]
    mean = math.fsum(sens) / len(sens) if sens else None
    lo: float | None = None
    hi: float | None = None
    if len(sens) >= 2:
        iv = t_interval(sens, CONFIDENCE)
        lo, hi = iv.lo, iv.hi
    init = math.fsum(l0_of.values()) / len(l0_of) if l0_of else None
    l_star = math.fsum(s.l_star for s in seeds) / len(seeds) if seeds else None
    return GroupResult(
        params, len(seeds), mean, lo, hi, init, curve, seeds, left_out, repeated, l_star
    )


def with_floor(group: GroupResult, floor: float | None, why_none: str | None) -> GroupResult:
    """The group with the unigram floor beside its `l*`, and the note METRICS.md section 9
    asks for when `l*` is not below it (or why there is no floor)."""
    note = why_none
    if floor is not None and group.l_star is not None and group.l_star >= floor:
        note = (
            f"l* {group.l_star:.4g} is not below the unigram floor {floor:.4g} of the data: "
            "these trials have not learned what attention is for, so draw no conclusion "
            "about attention from them (METRICS.md section 9)"
        )
    return dataclasses.replace(group, unigram_floor=floor, note=note)


def group_floor(
    study: Study, params: dict[str, Any], data_dir: str | None
) -> tuple[float | None, str | None]:
    """The unigram floor of a group's data (`workers/unigram.py`), or None with the reason:
    not language modelling, or the data cannot be read where the service runs."""
    try:
        config = apply_params(TrialConfig.model_validate(study.spec["base"]), params)
        if config.task.kind != "lm":
            return None, f"task {config.task.kind!r} has no corpus, so no unigram floor"
        config = config.model_copy(update={"task": resolve_task(config.task, data_dir)})
        return unigram_floor(config), None
    except (SpecError, OSError, ValueError, KeyError) as e:
        return None, f"the unigram floor could not be computed: {e}"


# --- the study: validation and reading its rows -----------------------------------------------


def _grid(study: Study) -> list[float]:
    space: dict[str, Any] = study.spec.get("search_space", {})
    p = space.get(LR_PARAM)
    if p is None or p.get("type") == "fixed":
        searched = ", ".join(k for k, v in space.items() if v.get("type") != "fixed") or "none"
        raise LrSensitivityError(
            LR_PARAM,
            f"study {study.id} does not search {LR_PARAM} (its searched parameters: "
            f"{searched}); LR sensitivity compares final losses across learning rates",
        )
    if p.get("type") == "categorical":
        values: list[Any] = list(p.get("choices", []))
    elif p.get("grid") and study.spec.get("sampler", {}).get("kind") == "grid":
        values = list(p["grid"])
    else:
        raise LrSensitivityError(
            LR_PARAM,
            f"{LR_PARAM} is sampled from a range, so seeds do not share learning rates; LR "
            "sensitivity needs a grid (sampler kind grid with a grid for optim.lr, or "
            "categorical choices)",
        )
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values):
        raise LrSensitivityError(LR_PARAM, f"learning rates must be positive numbers: {values}")
    return sorted({float(v) for v in values})


def _varies(p: dict[str, Any]) -> bool:
    """Whether a search-space parameter can take more than one value."""
    kind = p.get("type")
    if kind == "fixed":
        return False
    if kind == "categorical":
        return len(p.get("choices", [])) > 1
    if p.get("grid") is not None:
        return len(set(p["grid"])) > 1
    return True


def _group_by(study: Study, group_by: Sequence[str] | None) -> list[str]:
    space: dict[str, Any] = study.spec.get("search_space", {})
    others = [k for k, p in space.items() if k not in (LR_PARAM, SEED_PARAM) and _varies(p)]
    if not group_by:
        return others
    names = list(dict.fromkeys(group_by))
    for g in names:
        if g not in space:
            raise LrSensitivityError(
                "group_by",
                f"{g!r} is not a parameter of study {study.id}; its parameters: "
                f"{', '.join(space) or 'none'}",
            )
        if g in (LR_PARAM, SEED_PARAM):
            raise LrSensitivityError(
                "group_by",
                f"{g!r} cannot group: the curve runs over {LR_PARAM} and the interval over "
                f"{SEED_PARAM}",
            )
    pooled = [k for k in others if k not in names]
    if pooled:
        raise LrSensitivityError(
            "group_by",
            f"{', '.join(pooled)} also varies in study {study.id}: trials of a group must differ "
            f"only in {LR_PARAM} and {SEED_PARAM}; add group_by for "
            f"{'it' if len(pooled) == 1 else 'each'}",
        )
    return names


def _measures_init(study: Study) -> None:
    spec = study.spec
    if not spec.get("base", {}).get("eval_at_init") and "eval_at_init" not in spec.get(
        "search_space", {}
    ):
        raise LrSensitivityError(
            "base.eval_at_init",
            f"study {study.id} does not evaluate the untrained model, so l_0 (the step-0 "
            "validation loss) is unknown; set eval_at_init: true",
        )


def _log_spaced(grid: Sequence[float]) -> bool:
    if len(grid) < 3:
        return True
    steps = [math.log(b / a) for a, b in zip(grid, grid[1:], strict=False)]
    mean = math.fsum(steps) / len(steps)
    return all(abs(s - mean) <= LOG_SPACING_TOLERANCE * mean for s in steps)


def _on_grid(value: Any, grid: Sequence[float]) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    for eta in grid:
        if math.isclose(float(value), eta, rel_tol=1e-9):
            return eta
    return None


def _key(value: Any) -> Any:
    """A hashable form of a parameter value (JSON scalars already are)."""
    return value if isinstance(value, str | int | float | bool) or value is None else repr(value)


def _diverged(state: str, summary: dict[str, Any] | None, loss: float | None) -> bool:
    s = summary or {}
    return (
        state == TrialState.DIVERGED
        or s.get("status") == "diverged"
        or s.get("diverged_at_step") is not None
        or not _finite(loss)
    )


def study_lr_sensitivity(
    session: Session,
    study: Study,
    group_by: Sequence[str] | None = None,
    data_dir: str | None = None,
) -> LrSensitivity:
    """The study's LR sensitivity per group of `group_by` values (default: every searched
    parameter but optim.lr and seed), each beside the unigram floor of its data (read under
    `data_dir`, the service's QKSCOPE_DATA_DIR). Raises LrSensitivityError naming
    `optim.lr`, `group_by` or `base.eval_at_init` for a study it cannot answer."""
    grid = _grid(study)
    names = _group_by(study, group_by)
    _measures_init(study)
    rows, init = trial_rows_and_init_losses(session, study.id)
    groups: dict[tuple[Any, ...], list[TrialPoint]] = defaultdict(list)
    unfinished: dict[tuple[Any, ...], dict[int, dict[float, str]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    values: dict[tuple[Any, ...], dict[str, Any]] = {}
    for tid, seed, params, state, loss, summary_text in rows:
        summary = decode_summary(summary_text)
        eta = _on_grid((params or {}).get(LR_PARAM), grid)
        if eta is None:
            continue  # not a learning rate of today's grid
        gv = {g: (params or {}).get(g) for g in names}
        key = tuple(_key(v) for v in gv.values())
        values.setdefault(key, gv)
        ended = state in _RESULT_STATES
        diverged = ended and _diverged(state, summary, loss)
        if not ended or (state == TrialState.PRUNED and not diverged):
            # No final loss (not finished, failed, cancelled, or stopped early): missing.
            unfinished[key][int(seed)].setdefault(eta, str(state))
            continue
        l0: Any = init.get(tid)
        if not _finite(l0):
            l0 = (summary or {}).get("init_val_loss")
        groups[key].append(
            TrialPoint(
                int(seed),
                eta,
                None if loss is None else float(loss),
                diverged,
                float(l0) if _finite(l0) else None,
            )
        )
    results = [
        with_floor(
            summarize_group(values[k], grid, groups.get(k, []), unfinished.get(k)),
            *group_floor(study, values[k], data_dir),
        )
        for k in sorted(values, key=repr)
    ]
    return LrSensitivity(study.id, names, grid, _log_spaced(grid), CONFIDENCE, results)


def trial_rows_and_init_losses(
    session: Session, study_id: int
) -> tuple[list[Any], dict[int, float | None]]:
    """A study's trials as the learning-rate reads need them (id, seed, params, state, final
    validation loss, bounded summary; by number) and each trial's step-0 validation loss
    (by trial id): shared by LR sensitivity and the stability boundary."""
    rows = list(
        session.execute(
            select(
                Trial.id,
                Trial.seed,
                Trial.params,
                Trial.state,
                Trial.final_val_loss,
                bounded_summary(
                    session
                ),  # not its per-evaluation lists (service/read/summaries.py)
            )
            .where(Trial.study_id == study_id)
            .order_by(Trial.number)
        ).all()
    )
    init = dict(
        session.execute(
            select(Metric.trial_id, Metric.value)
            .join(Trial, Trial.id == Metric.trial_id)
            .where(
                Trial.study_id == study_id,
                Metric.name == "val_loss",
                Metric.step == 0,
                Metric.layer == NO_INDEX,
                Metric.head == NO_INDEX,
            )
        ).all()
    )
    return rows, init
