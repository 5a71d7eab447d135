"""The stability boundary across widths (METRICS.md section 11), read from a study's trials.

For one group of trials that differ only in learning rate `eta`, width `w` (by default
`model.d_model`, or `model.hf.config.hidden_size` for a Hugging Face model) and seed:

- per width and seed, `l_0` (the step-0 validation loss), `l(eta)` (the final validation
  loss; a diverged trial counts as `l_0`), `l* = min over eta of l(eta)` and `eta*` (its
  learning rate, the smallest on a tie);
- a trial is **unstable** when it diverged, violated one of the study's instability
  constraints (`stability.instability_constraints`), or ended above
  `l* + tau (l_0 - l*)` (`tau` 0.5 unless the study or the request sets it);
- `eta_max = sqrt(eta_s eta_u)`, with `eta_u` the first unstable learning rate above `eta*`
  and `eta_s` the one tried just below it; undefined when nothing above `eta*` is unstable
  (the grid does not reach the boundary) or when no learning rate trained below `l_0`.
  Learning rates tried that are not on the study's grid are the bisection's
  (`bisection_steps`); `ratio = eta_u / eta_s` is the final bracket;
- `eta_opt`: `eta*`, refined by the vertex of the parabola through the three points around
  it in `(log eta, l)` when it is interior;
- the fit `log eta = a + b log w` per seed by least squares over the widths where the value
  is defined (2 or more), then `b` and the prediction at `target_width` as the mean over
  seeds with a Student-t interval; the prediction is averaged in `log eta` (a geometric mean,
  the scale of the fit) and mapped back;
- the held-out check (3 or more widths): per seed, the refit without the largest width
  predicts `eta_max` there; `ratio = predicted / measured` (1 is perfect), averaged over
  seeds in log (a geometric mean) with its t interval.

Nothing is filled in: an undefined value is None with the reason beside it. Points are
computed from finished trials only; `unfinished` says how many trials of that width and
seed are still queued or running, so a running study's numbers can still move. A trial that
failed, was cancelled, or was pruned without diverging or violating an instability
constraint has no final loss: a missing point, left out.

Read-only, and bounded: one row per trial with its bounded summary
(service/read/summaries.py, never the per-evaluation lists) and the step-0 `val_loss` rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from service.errors import InvalidField
from service.read.intervals import t_interval
from service.read.lr_sensitivity import trial_rows_and_init_losses
from service.read.summaries import decode_summary
from service.spec.model import WIDTH_PARAMS
from service.store import OPEN_TRIAL_STATES, Study, TrialState

__all__ = [
    "CONFIDENCE",
    "DEFAULT_TAU",
    "WIDTH_PARAMS",
    "BandPoint",
    "BoundaryPoint",
    "Fit",
    "GroupBoundary",
    "Holdout",
    "Run",
    "StabilityBoundary",
    "boundary_point",
    "fit_power_law",
    "group_boundary",
    "holdout_check",
    "parabola_vertex",
    "study_stability_boundary",
]

LR_PARAM = "optim.lr"
SEED_PARAM = "seed"
DEFAULT_TAU = 0.5
CONFIDENCE = 0.95
BAND_POINTS = 16  # points of a fit's band, equally spaced in log width
_RESULT_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED)


# --- the computation on numbers ---------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One finished trial as the computation sees it (one width and seed)."""

    lr: float
    loss: float | None  # final validation loss; None or non-finite: diverged
    diverged: bool = False
    violated: bool = False  # an instability constraint was violated
    l0: float | None = None  # its step-0 validation loss


@dataclass(frozen=True)
class BoundaryPoint:
    """`eta_max` and `eta_opt` of one width and seed (None: undefined, `reason` says why)."""

    width: float
    seed: int
    n_lrs: int  # learning rates tried (finished)
    l0: float | None
    l_star: float | None
    eta_star: float | None
    eta_opt: float | None
    eta_max: float | None
    eta_s: float | None  # the largest stable learning rate below eta_u
    eta_u: float | None  # the first unstable learning rate above eta*
    ratio: float | None  # eta_u / eta_s
    bisection_steps: int  # learning rates tried off the study's grid
    unstable: list[float]  # the unstable learning rates, ascending
    reason: str | None  # why eta_max is undefined
    unfinished: int = 0  # trials of this width and seed without a result yet


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parabola_vertex(x: Sequence[float], y: Sequence[float]) -> float | None:
    """The x of the vertex of the parabola through three points (x ascending), or None when
    they are collinear or the parabola opens downward (no minimum)."""
    (x1, x2, x3), (y1, y2, y3) = x, y
    den = (x2 - x1) * (y2 - y3) - (x2 - x3) * (y2 - y1)
    # the leading coefficient's sign: positive curvature when the middle point lies below
    # the chord through the outer two
    chord = y1 + (y3 - y1) * (x2 - x1) / (x3 - x1)
    if den == 0 or not y2 < chord:
        return None
    num = (x2 - x1) ** 2 * (y2 - y3) - (x2 - x3) ** 2 * (y2 - y1)
    return x2 - 0.5 * num / den


def boundary_point(
    width: float,
    seed: int,
    runs: Sequence[Run],
    tau: float = DEFAULT_TAU,
    grid: Sequence[float] | None = None,
    unfinished: int = 0,
) -> BoundaryPoint:
    """METRICS.md 11 for one width and seed. The first run of each learning rate is used.
    `grid`: the study's grid of learning rates; runs off it are bisection steps."""
    by_lr: dict[float, Run] = {}
    for r in runs:
        by_lr.setdefault(float(r.lr), r)
    lrs = sorted(by_lr)
    on_grid = [float(g) for g in grid] if grid else None
    steps = (
        sum(not any(math.isclose(e, g, rel_tol=1e-9) for g in on_grid) for e in lrs)
        if on_grid is not None
        else 0
    )
    inits = [r.l0 for r in by_lr.values() if r.l0 is not None and math.isfinite(r.l0)]

    def undefined(reason: str, **known: Any) -> BoundaryPoint:
        return BoundaryPoint(
            width, seed, len(lrs), known.get("l0"), known.get("l_star"),
            known.get("eta_star"), known.get("eta_opt"), None, None, None, None, steps,
            known.get("unstable", []), reason, unfinished,
        )  # fmt: skip

    if not lrs:
        return undefined("no finished trial")
    if not inits:
        return undefined("no step-0 evaluation (eval_at_init): l_0 is unknown")
    l0 = math.fsum(inits) / len(inits)
    bad = {e: by_lr[e].diverged or not _finite(by_lr[e].loss) for e in lrs}
    loss = {e: l0 if bad[e] else float(by_lr[e].loss) for e in lrs}  # type: ignore[arg-type]
    l_star = min(loss.values())
    if not l_star < l0:
        return undefined(
            "no learning rate trained below l_0 (every one diverged or lost what it gained)",
            l0=l0,
            unstable=lrs,
        )
    i_star = next(i for i, e in enumerate(lrs) if loss[e] == l_star)
    eta_star = lrs[i_star]
    threshold = l_star + tau * (l0 - l_star)
    unstable = [e for e in lrs if bad[e] or by_lr[e].violated or loss[e] > threshold]
    eta_opt = eta_star
    if 0 < i_star < len(lrs) - 1:
        xs = [math.log(lrs[i]) for i in (i_star - 1, i_star, i_star + 1)]
        v = parabola_vertex(xs, [loss[lrs[i]] for i in (i_star - 1, i_star, i_star + 1)])
        if v is not None:
            eta_opt = math.exp(v)
    known = dict(l0=l0, l_star=l_star, eta_star=eta_star, eta_opt=eta_opt, unstable=unstable)
    above = [i for i in range(i_star + 1, len(lrs)) if lrs[i] in unstable]
    if eta_star in unstable:  # violated a constraint at the best loss: nothing is stable
        return undefined("the best learning rate violated an instability constraint", **known)
    if not above:
        return undefined(
            "nothing above eta* is unstable: the learning rates tried do not reach the boundary",
            **known,
        )
    iu = above[0]
    eta_s, eta_u = lrs[iu - 1], lrs[iu]
    return BoundaryPoint(
        width, seed, len(lrs), l0, l_star, eta_star, eta_opt, math.sqrt(eta_s * eta_u),
        eta_s, eta_u, eta_u / eta_s, steps, unstable, None, unfinished,
    )  # fmt: skip


@dataclass(frozen=True)
class SeedFit:
    seed: int
    widths: list[float]  # the widths the fit used
    a: float
    b: float
    prediction: float  # exp(a + b log target_width)


@dataclass(frozen=True)
class Fit:
    """`log eta = a + b log w`: b and the prediction at `target_width` over seeds."""

    target_width: float
    n_seeds: int
    b: float | None
    b_low: float | None
    b_high: float | None
    prediction: float | None  # geometric mean over seeds
    prediction_low: float | None
    prediction_high: float | None
    seeds: list[SeedFit]
    left_out: list[dict[str, Any]]  # {seed, reason}
    reason: str | None = None  # why there is no fit
    # the fitted line from the smallest width fitted to target_width, each point the
    # geometric mean over seeds of exp(a + b log w) with its t interval (a UI's band)
    band: list[BandPoint] = field(default_factory=list)


@dataclass(frozen=True)
class BandPoint:
    width: float
    eta: float
    low: float | None
    high: float | None


def _least_squares(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(a, b) of y = a + b x by ordinary least squares (at least two distinct x)."""
    n = len(x)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    sxx = math.fsum((v - mx) ** 2 for v in x)
    sxy = math.fsum((u - mx) * (v - my) for u, v in zip(x, y, strict=True))
    b = sxy / sxx
    return my - b * mx, b


def _mean_interval(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, None, None
    iv = t_interval(values, CONFIDENCE)
    return mean, iv.lo, iv.hi


def fit_power_law(values: Mapping[int, Mapping[float, float | None]], target_width: float) -> Fit:
    """Per seed (`values`: seed -> width -> eta, None where undefined) the least-squares fit
    of `log eta` on `log w` over the widths where it is defined; a seed with fewer than two
    is left out. Then b and the prediction at `target_width` over the seeds fitted."""
    fits: list[SeedFit] = []
    left_out: list[dict[str, Any]] = []
    for seed in sorted(values):
        pts = sorted((w, e) for w, e in values[seed].items() if e is not None and e > 0)
        if len(pts) < 2:
            left_out.append(
                {"seed": seed, "reason": f"defined at {len(pts)} width(s); a fit needs 2"}
            )
            continue
        a, b = _least_squares([math.log(w) for w, _ in pts], [math.log(e) for _, e in pts])
        pred = math.exp(a + b * math.log(target_width))
        fits.append(SeedFit(seed, [w for w, _ in pts], a, b, pred))
    if not fits:
        return Fit(target_width, 0, None, None, None, None, None, None, [], left_out,
                   "no seed has the value at two widths")  # fmt: skip
    b, b_lo, b_hi = _mean_interval([f.b for f in fits])
    lp, lp_lo, lp_hi = _mean_interval([math.log(f.prediction) for f in fits])
    lo_w = math.log(min(min(f.widths) for f in fits))
    hi_w = math.log(max(target_width, max(max(f.widths) for f in fits)))
    band = []
    for k in range(BAND_POINTS):
        lw = lo_w + (hi_w - lo_w) * k / (BAND_POINTS - 1)
        m, lo, hi = _mean_interval([f.a + f.b * lw for f in fits])
        band.append(BandPoint(math.exp(lw), math.exp(m), _exp(lo), _exp(hi)))
    return Fit(
        target_width, len(fits), b, b_lo, b_hi, math.exp(lp), _exp(lp_lo), _exp(lp_hi),
        fits, left_out, None, band,
    )  # fmt: skip


def _exp(v: float | None) -> float | None:
    return None if v is None else math.exp(v)


@dataclass(frozen=True)
class SeedHoldout:
    seed: int
    predicted: float
    measured: float
    ratio: float  # predicted / measured


@dataclass(frozen=True)
class Holdout:
    """The refit without the largest width, checked against `eta_max` measured there."""

    width: float  # the largest width, held out
    n_seeds: int
    ratio: float | None  # geometric mean over seeds of predicted / measured
    ratio_low: float | None
    ratio_high: float | None
    seeds: list[SeedHoldout]
    left_out: list[dict[str, Any]]
    reason: str | None = None


def holdout_check(values: Mapping[int, Mapping[float, float | None]]) -> Holdout | None:
    """`values`: seed -> width -> eta_max. None below three widths (in all)."""
    widths = sorted({w for v in values.values() for w in v})
    if len(widths) < 3:
        return None
    top = widths[-1]
    seeds: list[SeedHoldout] = []
    left_out: list[dict[str, Any]] = []
    for seed in sorted(values):
        measured = values[seed].get(top)
        if measured is None:
            left_out.append({"seed": seed, "reason": f"eta_max undefined at width {top:g}"})
            continue
        rest = {w: e for w, e in values[seed].items() if w != top}
        fit = fit_power_law({seed: rest}, top)
        if not fit.seeds:
            left_out.append({"seed": seed, "reason": fit.left_out[0]["reason"]})
            continue
        pred = fit.seeds[0].prediction
        seeds.append(SeedHoldout(seed, pred, measured, pred / measured))
    if not seeds:
        return Holdout(top, 0, None, None, None, [], left_out, "no seed can be checked")
    m, lo, hi = _mean_interval([math.log(s.ratio) for s in seeds])
    return Holdout(
        top, len(seeds), math.exp(m), None if lo is None else math.exp(lo),
        None if hi is None else math.exp(hi), seeds, left_out,
    )  # fmt: skip


@dataclass(frozen=True)
class GroupBoundary:
    params: dict[str, Any]  # the group_by parameters' values
    widths: list[float]
    points: list[BoundaryPoint]
    eta_max_fit: Fit
    eta_opt_fit: Fit
    holdout: Holdout | None  # None below three widths
    repeated: int = 0  # finished trials beyond the first of a (width, seed, eta)


def group_boundary(
    params: dict[str, Any],
    runs: Mapping[tuple[float, int], Sequence[Run]],
    target_width: float,
    tau: float = DEFAULT_TAU,
    grid: Sequence[float] | None = None,
    unfinished: Mapping[tuple[float, int], int] | None = None,
) -> GroupBoundary:
    """A group's points (one per (width, seed) in `runs` or `unfinished`), both fits and the
    held-out check."""
    unfinished = unfinished or {}
    keys = sorted(set(runs) | set(unfinished))
    points = [
        boundary_point(w, s, runs.get((w, s), []), tau, grid, unfinished.get((w, s), 0))
        for w, s in keys
    ]
    repeated = sum(len(r) - len({x.lr for x in r}) for r in runs.values())
    emax: dict[int, dict[float, float | None]] = defaultdict(dict)
    eopt: dict[int, dict[float, float | None]] = defaultdict(dict)
    for p in points:
        emax[p.seed][p.width] = p.eta_max
        eopt[p.seed][p.width] = p.eta_opt
    return GroupBoundary(
        params,
        sorted({w for w, _ in keys}),
        points,
        fit_power_law(emax, target_width),
        fit_power_law(eopt, target_width),
        holdout_check(emax),
        repeated,
    )


@dataclass(frozen=True)
class StabilityBoundary:
    study_id: int
    width: str  # the parameter that is the width
    group_by: list[str]
    target_width: float
    tau: float
    instability_constraints: list[str]
    confidence: float
    groups: list[GroupBoundary] = field(default_factory=list)


# --- the study: validation and reading its rows -----------------------------------------------


def _values(p: Mapping[str, Any]) -> list[Any] | None:
    """The finite set of values a search-space parameter takes, or None for a range."""
    kind = p.get("type")
    if kind == "fixed":
        return [p.get("value")]
    if kind == "categorical":
        return list(p.get("choices", []))
    if p.get("grid") is not None:
        return list(p["grid"])
    return None


def _width_param(study: Study, width: str | None) -> str:
    space: dict[str, Any] = study.spec.get("search_space", {})
    stated = (study.spec.get("stability") or {}).get("width")
    if width is None:
        width = stated or next((w for w in WIDTH_PARAMS if w in space), None)
    if width in (LR_PARAM, SEED_PARAM):
        raise InvalidField("width", f"{width} cannot be the width: the boundary runs over it")
    if width is None or width not in space:
        raise InvalidField(
            "width",
            f"study {study.id} does not search {width or ' or '.join(WIDTH_PARAMS)}; the "
            "stability boundary compares widths (name the width parameter with width=)",
        )
    vals = _values(space[width])
    if vals is not None and len(set(vals)) < 2:
        raise InvalidField(
            "width",
            f"study {study.id} has one width ({width} = {vals[0]}); a fit across widths "
            "needs at least two",
        )
    if vals is not None and not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in vals
    ):
        raise InvalidField("width", f"{width} takes values that are not positive numbers")
    return width


def _lr_grid(study: Study) -> list[float] | None:
    space: dict[str, Any] = study.spec.get("search_space", {})
    p = space.get(LR_PARAM)
    if p is None or p.get("type") == "fixed":
        raise InvalidField(
            LR_PARAM,
            f"study {study.id} does not search {LR_PARAM}; the stability boundary walks the "
            "learning rates tried at each width",
        )
    vals = _values(p)
    return sorted(float(v) for v in vals) if vals is not None else None


def _group_by(study: Study, width: str, group_by: Sequence[str] | None) -> list[str]:
    space: dict[str, Any] = study.spec.get("search_space", {})
    fixed = (LR_PARAM, SEED_PARAM, width)

    def varies(p: Mapping[str, Any]) -> bool:
        vals = _values(p)
        return vals is None or len(set(map(repr, vals))) > 1

    others = [k for k, p in space.items() if k not in fixed and varies(p)]
    if not group_by:
        return others
    names = list(dict.fromkeys(group_by))
    for g in names:
        if g not in space:
            raise InvalidField(
                "group_by",
                f"{g!r} is not a parameter of study {study.id}; its parameters: "
                f"{', '.join(space) or 'none'}",
            )
        if g in fixed:
            raise InvalidField(
                "group_by", f"{g!r} cannot group: the boundary runs over {', '.join(fixed)}"
            )
    pooled = [k for k in others if k not in names]
    if pooled:
        raise InvalidField(
            "group_by",
            f"{', '.join(pooled)} also varies in study {study.id}: trials of a group must "
            f"differ only in {LR_PARAM}, {width} and {SEED_PARAM}; add group_by for it",
        )
    return names


def _measures_init(study: Study) -> None:
    spec = study.spec
    if not spec.get("base", {}).get("eval_at_init") and "eval_at_init" not in spec.get(
        "search_space", {}
    ):
        raise InvalidField(
            "base.eval_at_init",
            f"study {study.id} does not evaluate the untrained model, so l_0 (the step-0 "
            "validation loss) is unknown and the tau rule cannot be applied; set "
            "eval_at_init: true",
        )


def _tau(study: Study, tau: float | None) -> float:
    if tau is None:
        tau = float((study.spec.get("stability") or {}).get("tau", DEFAULT_TAU))
    if not (_finite(tau) and 0.0 < tau <= 1.0):
        raise InvalidField("tau", f"must be in (0, 1], got {tau!r}")
    return float(tau)


def _key(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) or value is None else repr(value)


def _violated(study: Study, names: Sequence[str], summary: Mapping[str, Any] | None) -> bool:
    """Whether an instability constraint (a study constraint on one of `names`) failed."""
    if not names:
        return False
    from service.spec.model import Constraint

    steps = int(study.spec.get("base", {}).get("steps", 0) or 0)
    s = dict(summary or {})
    for c in study.spec.get("constraints", []):
        if c.get("metric") in names and s.get(c["metric"]) is not None:
            con = Constraint.model_validate(c)
            v = s[c["metric"]]
            if not _finite(v) or con.violation(s, steps) > 0:
                return True
    return False


def study_stability_boundary(
    session: Session,
    study: Study,
    width: str | None = None,
    group_by: Sequence[str] | None = None,
    target_width: float | None = None,
    tau: float | None = None,
) -> StabilityBoundary:
    """METRICS.md section 11 for the study per group. Raises InvalidField naming `width`,
    `optim.lr`, `group_by`, `target_width`, `tau` or `base.eval_at_init` for a study or a
    request it cannot answer."""
    wname = _width_param(study, width)
    grid = _lr_grid(study)
    names = _group_by(study, wname, group_by)
    _measures_init(study)
    tau_v = _tau(study, tau)
    if target_width is not None and not (_finite(target_width) and target_width > 0):
        raise InvalidField("target_width", f"must be a positive number, got {target_width!r}")
    inst = list((study.spec.get("stability") or {}).get("instability_constraints", []))
    rows, init = trial_rows_and_init_losses(session, study.id)
    runs: dict[tuple[Any, ...], dict[tuple[float, int], list[Run]]] = defaultdict(
        lambda: defaultdict(list)
    )
    unfinished: dict[tuple[Any, ...], dict[tuple[float, int], int]] = defaultdict(
        lambda: defaultdict(int)
    )
    values: dict[tuple[Any, ...], dict[str, Any]] = {}
    widths: set[float] = set()
    for tid, seed, params, state, loss, summary_text in rows:
        p = params or {}
        w_any: Any = p.get(wname)
        eta_any: Any = p.get(LR_PARAM)
        if not (_finite(w_any) and _finite(eta_any) and w_any > 0 and eta_any > 0):
            continue  # not a trial of the ladder (no width or learning rate)
        w, eta = float(w_any), float(eta_any)
        gv = {g: p.get(g) for g in names}
        key = tuple(_key(v) for v in gv.values())
        values.setdefault(key, gv)
        widths.add(float(w))
        summary = decode_summary(summary_text)
        s = summary or {}
        ended = state in _RESULT_STATES
        diverged = ended and (
            state == TrialState.DIVERGED
            or s.get("status") == "diverged"
            or s.get("diverged_at_step") is not None
            or not _finite(loss)
        )
        violated = ended and _violated(study, inst, summary)
        if state in OPEN_TRIAL_STATES:
            unfinished[key][(w, int(seed))] += 1  # no result yet: the point may still move
            continue
        if not ended or (state == TrialState.PRUNED and not diverged and not violated):
            continue  # failed, cancelled, or stopped early without a final loss: missing
        l0: Any = init.get(tid)
        if not _finite(l0):
            l0 = s.get("init_val_loss")
        runs[key][(float(w), int(seed))].append(
            Run(
                float(eta),
                float(loss) if _finite(loss) else None,
                diverged,
                violated,
                float(l0) if _finite(l0) else None,
            )
        )
    target = float(target_width) if target_width is not None else max(widths, default=1.0)
    groups = [
        group_boundary(values[k], runs.get(k, {}), target, tau_v, grid, unfinished.get(k))
        for k in sorted(values, key=repr)
    ]
    return StabilityBoundary(study.id, wname, names, target, tau_v, inst, CONFIDENCE, groups)
