"""Plots of a study's results: the data behind each plot, and its PNG.

Two halves, kept apart so that the data can be served as JSON and tested on its own:

- `plot_data(session, study, kind, options)` reads the database and returns plain,
  JSON-ready dicts (no matplotlib involved);
- `render_png(data, width, height)` draws that dict with matplotlib's Agg backend
  (object API only, no pyplot state, no display). matplotlib is imported inside the
  rendering functions, so importing this module, or the API, stays light.

Kinds:

- `metric`: one per-step metric (`metric=`, default `val_loss`) for chosen trials
  (`trials=3,7`; default: the best few COMPLETE trials, or the latest trials while none
  has completed), narrowed with `layer=` / `head=`; one line per (trial, layer, head).
- `scatter`: a summary metric (`y=`, default the first objective's metric) against a
  parameter or metric (`x=params.<path>`, default the first search-space parameter),
  coloured by a third (`color=`, default the second search-space parameter; `none`).
- `phase`: the collapse phase diagram: every measured trial (COMPLETE, PRUNED, DIVERGED)
  at (`x`, `y`) (default: the first two search-space parameters), coloured by its
  collapse class (`COLLAPSE_CLASSES`, see `collapse_class`).
- `pareto`: the Pareto front of COMPLETE trials over all objectives, drawn on two of
  them (`x=`/`y=` name objective metrics; default the first two); for a single
  objective, every COMPLETE trial ranked by its value with the best one marked.
- `importance`: the search-space parameters ranked by importance for `target=` (an
  objective or summary metric) with `evaluator=` fanova (default) or ped_anova; empty, with a
  note saying how many trials it needs, until enough trials have completed.
- `history`: the objective value (`objective=` index, default 0) of every trial by trial
  number, with the running best of the COMPLETE feasible trials.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import NO_INDEX, Metric, Study, Trial, TrialState
from service.spec import SUMMARY_METRICS

__all__ = [
    "COLLAPSE_CLASSES",
    "DEFAULT_TRIALS",
    "KNOWN_METRICS",
    "MAX_TRIALS",
    "PLOT_KINDS",
    "PlotError",
    "PlotOptions",
    "collapse_class",
    "field_value",
    "pareto_front",
    "plot_data",
    "render_png",
]

PLOT_KINDS = ("metric", "scatter", "phase", "pareto", "history", "importance")
COLLAPSE_CLASSES = ("healthy", "entropy_collapse", "rank_collapse", "both", "diverged", "trapped")
# Metric names the trials write (README "Metric names"), by what they are indexed by.
SCALAR_METRICS = ("train_loss", "val_loss", "grad_norm", "lr", "reg_penalty")
LAYER_METRICS = ("rank_ratio",)
HEAD_METRICS = ("attn_entropy", "attn_entropy_norm", "qk_eig_mean", "qk_eig_var")
KNOWN_METRICS = SCALAR_METRICS + LAYER_METRICS + HEAD_METRICS
DEFAULT_TRIALS = 5  # the "best few" of a metric plot
MAX_TRIALS = 20  # trials on one metric plot
MEASURED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED)

# Fields a scatter/phase axis or colour may name besides params.<path>: numbers first.
_COLUMNS = (
    "value",
    "final_val_loss",
    "min_norm_entropy",
    "final_rank_ratio",
    "qk_eig_var",
    "plateau_steps",
    "duration_s",
    "last_step",
    "number",
)
NUMERIC_FIELDS = tuple(dict.fromkeys((*_COLUMNS, *SUMMARY_METRICS)))
FLAG_FIELDS = ("entropy_collapse", "rank_collapse", "trapped", "feasible")
CATEGORY_FIELDS = ("state", "collapse_class")
_METRIC_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII only: str.isdigit() also accepts "²"
_TABLE_COLUMNS = frozenset((*_COLUMNS, *FLAG_FIELDS, "state"))


class PlotError(ValueError):
    """A bad plot parameter, with the query parameter's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class PlotOptions:
    """The query parameters of a plot; each kind reads the ones it needs."""

    metric: str | None = None
    trials: str | None = None  # comma-separated trial numbers
    layer: int | None = None
    head: int | None = None
    x: str | None = None
    y: str | None = None
    color: str | None = None
    objective: int = 0
    feasible_only: bool = True
    target: str | None = None  # importance: objective name or summary metric
    evaluator: str = "fanova"  # importance: fanova or ped_anova


# ---- fields of a trial ------------------------------------------------------------------------


def _finite(v: Any) -> Any:
    """JSON-safe: NaN and infinities become None; bools and strings pass through."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def collapse_class(t: Trial) -> str | None:
    """The trial's collapse class, or None while it has not been measured.

    Precedence: diverged, then both collapses, entropy collapse, rank collapse, then a
    trapped loss plateau, else healthy. Only COMPLETE, PRUNED and DIVERGED trials are
    classified.
    """
    if t.state == TrialState.DIVERGED or (t.summary or {}).get("status") == "diverged":
        return "diverged"
    if t.state not in MEASURED or (t.entropy_collapse is None and t.rank_collapse is None):
        return None
    if t.entropy_collapse and t.rank_collapse:
        return "both"
    if t.entropy_collapse:
        return "entropy_collapse"
    if t.rank_collapse:
        return "rank_collapse"
    if t.trapped:
        return "trapped"
    return "healthy"


def field_value(t: Trial, name: str) -> Any:
    """A trial's value of `params.<path>`, a summary column or metric, a flag or a category."""
    if name.startswith("params."):
        return _finite(t.params.get(name.removeprefix("params.")))
    if name == "collapse_class":
        return collapse_class(t)
    if name in _TABLE_COLUMNS:
        return _finite(getattr(t, name))
    return _finite((t.summary or {}).get(name))


def _space(study: Study) -> dict[str, dict[str, Any]]:
    space: dict[str, dict[str, Any]] = study.spec.get("search_space", {})
    return space


def _param_is_numeric(param: dict[str, Any]) -> bool:
    if param.get("type") in ("float", "int"):
        return True
    if param.get("type") == "fixed":
        v = param.get("value")
        return isinstance(v, int | float) and not isinstance(v, bool)
    return False


def _check_field(study: Study, name: str, query: str, *, numeric: bool) -> None:
    """`name` must be a search-space parameter (params.<path>) or a known trial field."""
    if name.startswith("params."):
        path = name.removeprefix("params.")
        space = _space(study)
        if path not in space:
            known = ", ".join(f"params.{p}" for p in space) or "none"
            raise PlotError(query, f"{path!r} is not in the search space (parameters: {known})")
        if numeric and not _param_is_numeric(space[path]):
            raise PlotError(query, f"{name} is categorical; this axis needs a number")
        return
    allowed = NUMERIC_FIELDS if numeric else NUMERIC_FIELDS + FLAG_FIELDS + CATEGORY_FIELDS
    if name not in allowed:
        raise PlotError(
            query, f"unknown field {name!r}; use params.<path> or one of {', '.join(allowed)}"
        )


def _is_log(study: Study, name: str) -> bool:
    if not name.startswith("params."):
        return False
    return bool(_space(study).get(name.removeprefix("params."), {}).get("log", False))


def _default_params(study: Study, n: int) -> list[str]:
    return [f"params.{p}" for p in list(_space(study))[:n]]


def _objectives(study: Study) -> list[dict[str, str]]:
    objs: list[dict[str, str]] = study.spec.get("objectives") or [
        {"metric": "final_val_loss", "direction": "minimize"}
    ]
    return [{"metric": o["metric"], "direction": o.get("direction", "minimize")} for o in objs]


def _values(t: Trial) -> list[float | None]:
    if t.values is not None:
        return [_finite(float(v)) if v is not None else None for v in t.values]
    return [_finite(t.value)]


def _trials(session: Session, study: Study, states: tuple[str, ...] | None = None) -> list[Trial]:
    q = select(Trial).where(Trial.study_id == study.id)
    if states is not None:
        q = q.where(Trial.state.in_(states))
    return list(session.scalars(q.order_by(Trial.number)).all())


# ---- the data of each kind -------------------------------------------------------------------


def pareto_front(
    points: dict[int, list[float]], directions: list[str], *, include_ties: bool = True
) -> set[int]:
    """Keys of the non-dominated points (the same rule as GET /best)."""
    sign = [1.0 if d == "minimize" else -1.0 for d in directions]
    keyed = {k: [s * v for s, v in zip(sign, vals, strict=True)] for k, vals in points.items()}

    def dominated(a: list[float]) -> bool:
        return any(
            all(x <= y for x, y in zip(b, a, strict=True)) and b != a for b in keyed.values()
        )

    return {k for k, a in keyed.items() if not dominated(a)}


def _parse_trials(raw: str) -> list[int]:
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if not _NUMBER.fullmatch(part):
            raise PlotError("trials", f"{part!r} is not a trial number")
        out.append(int(part))
    if not out:
        raise PlotError("trials", "give one or more trial numbers, comma-separated")
    if len(out) > MAX_TRIALS:
        raise PlotError("trials", f"at most {MAX_TRIALS} trials on one plot")
    return list(dict.fromkeys(out))


def default_metric_trials(session: Session, study: Study, n: int = DEFAULT_TRIALS) -> list[Trial]:
    """The best `n` COMPLETE feasible trials by the first objective; while there are none,
    the `n` latest trials (so a running study can be watched)."""
    direction = _objectives(study)[0]["direction"]
    order = Trial.value.desc() if direction == "maximize" else Trial.value.asc()
    best = session.scalars(
        select(Trial)
        .where(
            Trial.study_id == study.id,
            Trial.state == TrialState.COMPLETE,
            Trial.value.is_not(None),
            Trial.feasible.is_not(False),
        )
        .order_by(order, Trial.number)
        .limit(n)
    ).all()
    if best:
        return list(best)
    latest = session.scalars(
        select(Trial).where(Trial.study_id == study.id).order_by(Trial.number.desc()).limit(n)
    ).all()
    return sorted(latest, key=lambda t: t.number)


def _metric_data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    metric = o.metric or "val_loss"
    if not _METRIC_NAME.fullmatch(metric):
        raise PlotError("metric", f"{metric!r} is not a metric name (letters, digits and _)")
    if metric in SCALAR_METRICS and (o.layer is not None or o.head is not None):
        raise PlotError("layer" if o.layer is not None else "head", f"{metric} has no layer/head")
    if metric in LAYER_METRICS and o.head is not None:
        raise PlotError("head", f"{metric} is measured per layer, not per head")
    if o.trials:
        numbers = _parse_trials(o.trials)
        found = session.scalars(
            select(Trial).where(Trial.study_id == study.id, Trial.number.in_(numbers))
        ).all()
        by_number = {t.number: t for t in found}
        missing = [n for n in numbers if n not in by_number]
        if missing:
            raise PlotError(
                "trials", f"no trial number {', '.join(map(str, missing))} in study {study.id}"
            )
        chosen = [by_number[n] for n in numbers]
    else:
        chosen = default_metric_trials(session, study)
    if metric not in KNOWN_METRICS:
        stored = session.scalar(
            select(Metric.name)
            .join(Trial, Trial.id == Metric.trial_id)
            .where(Trial.study_id == study.id, Metric.name == metric)
            .limit(1)
        )
        if stored is None:
            raise PlotError(
                "metric", f"unknown metric {metric!r}; known: {', '.join(KNOWN_METRICS)}"
            )
    series: list[dict[str, Any]] = []
    if chosen:
        q = select(Metric).where(Metric.trial_id.in_([t.id for t in chosen]), Metric.name == metric)
        if o.layer is not None:
            q = q.where(Metric.layer == o.layer)
        if o.head is not None:
            q = q.where(Metric.head == o.head)
        rows = session.scalars(
            q.order_by(Metric.trial_id, Metric.layer, Metric.head, Metric.step)
        ).all()
        grouped: dict[tuple[int, int, int], list[Metric]] = {}
        for r in rows:
            grouped.setdefault((r.trial_id, r.layer, r.head), []).append(r)
        number_of = {t.id: t.number for t in chosen}
        rank = {t.id: i for i, t in enumerate(chosen)}
        for (tid, layer, head), pts in sorted(
            grouped.items(), key=lambda kv: (rank[kv[0][0]], kv[0][1], kv[0][2])
        ):
            series.append(
                {
                    "trial": number_of[tid],
                    "trial_id": tid,
                    "layer": None if layer == NO_INDEX else layer,
                    "head": None if head == NO_INDEX else head,
                    "steps": [p.step for p in pts],
                    "values": [_finite(p.value) for p in pts],
                }
            )
    return {
        "kind": "metric",
        "study_id": study.id,
        "metric": metric,
        "layer": o.layer,
        "head": o.head,
        "trials": [t.number for t in chosen],
        "series": series,
        "x_label": "step",
        "y_label": metric,
        "title": f"study {study.id}: {metric}",
    }


def _scatter_data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    defaults = _default_params(study, 2)
    x = o.x or (defaults[0] if defaults else None)
    if x is None:
        raise PlotError("x", "this study has no search space: name a field with x=")
    y = o.y or _objectives(study)[0]["metric"]
    color = o.color if o.color is not None else (defaults[1] if len(defaults) > 1 else None)
    if color in ("", "none"):
        color = None
    _check_field(study, x, "x", numeric=False)
    _check_field(study, y, "y", numeric=True)
    if color is not None:
        _check_field(study, color, "color", numeric=False)
    points = []
    for t in _trials(session, study, MEASURED):
        xv, yv = field_value(t, x), field_value(t, y)
        if xv is None or yv is None:
            continue
        points.append(
            {
                "trial": t.number,
                "state": t.state,
                "x": xv,
                "y": yv,
                "color": None if color is None else field_value(t, color),
            }
        )
    return {
        "kind": "scatter",
        "study_id": study.id,
        "x": x,
        "y": y,
        "color": color,
        "x_log": _is_log(study, x),
        "y_log": _is_log(study, y),
        "color_log": color is not None and _is_log(study, color),
        "points": points,
        "x_label": x,
        "y_label": y,
        "title": f"study {study.id}: {y} vs {x}",
    }


def _phase_data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    defaults = _default_params(study, 2)
    x = o.x or (defaults[0] if defaults else None)
    y = o.y or (defaults[1] if len(defaults) > 1 else None)
    if x is None or y is None:
        raise PlotError(
            "x" if x is None else "y",
            "the search space has fewer than two parameters: name both axes with x= and y=",
        )
    _check_field(study, x, "x", numeric=False)
    _check_field(study, y, "y", numeric=False)
    points = []
    counts = dict.fromkeys(COLLAPSE_CLASSES, 0)
    for t in _trials(session, study, MEASURED):
        cls = collapse_class(t)
        xv, yv = field_value(t, x), field_value(t, y)
        if cls is None or xv is None or yv is None:
            continue
        counts[cls] += 1
        points.append({"trial": t.number, "state": t.state, "x": xv, "y": yv, "class": cls})
    return {
        "kind": "phase",
        "study_id": study.id,
        "x": x,
        "y": y,
        "x_log": _is_log(study, x),
        "y_log": _is_log(study, y),
        "classes": list(COLLAPSE_CLASSES),
        "counts": counts,
        "points": points,
        "x_label": x,
        "y_label": y,
        "title": f"study {study.id}: collapse phase diagram",
    }


def _objective_index(objs: list[dict[str, str]], name: str | None, default: int, q: str) -> int:
    if name is None:
        return default
    metrics = [ob["metric"] for ob in objs]
    if _NUMBER.fullmatch(name) and int(name) < len(objs):
        return int(name)
    if name in metrics:
        return metrics.index(name)
    raise PlotError(q, f"{name!r} is not an objective of this study (objectives: {metrics})")


def _pareto_data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    objs = _objectives(study)
    directions = [ob["direction"] for ob in objs]
    complete = [
        t
        for t in _trials(session, study, (TrialState.COMPLETE,))
        if len(_values(t)) == len(objs) and None not in _values(t)
    ]
    cands = {
        t.number: [float(v) for v in _values(t) if v is not None]
        for t in complete
        if not o.feasible_only or t.feasible is not False
    }
    front = pareto_front(cands, directions)
    points: list[dict[str, Any]] = [
        {
            "trial": t.number,
            "values": _values(t),
            "feasible": t.feasible,
            "on_front": t.number in front,
        }
        for t in complete
    ]
    data: dict[str, Any] = {
        "kind": "pareto",
        "study_id": study.id,
        "objectives": objs,
        "feasible_only": o.feasible_only,
        "front": sorted(front),
        "points": points,
    }
    if len(objs) == 1:
        sign = 1.0 if directions[0] == "minimize" else -1.0
        points.sort(key=lambda p: (sign * p["values"][0], p["trial"]))
        for i, p in enumerate(points):
            p["rank"] = i + 1
        data.update(
            x_label="rank", y_label=objs[0]["metric"], title=f"study {study.id}: best vs all"
        )
        return data
    xi = _objective_index(objs, o.x, 0, "x")
    yi = _objective_index(objs, o.y, 1, "y")
    data.update(
        x_objective=xi,
        y_objective=yi,
        x_label=objs[xi]["metric"],
        y_label=objs[yi]["metric"],
        title=f"study {study.id}: Pareto front",
    )
    return data


def _history_data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    objs = _objectives(study)
    if not 0 <= o.objective < len(objs):
        raise PlotError(
            "objective", f"this study has {len(objs)} objective(s): use 0..{len(objs) - 1}"
        )
    i = o.objective
    sign = 1.0 if objs[i]["direction"] == "minimize" else -1.0
    points: list[dict[str, Any]] = []
    best: list[dict[str, Any]] = []
    current: float | None = None
    for t in _trials(session, study):
        vals = _values(t)
        v = vals[i] if i < len(vals) else None
        if v is None:
            continue
        points.append({"trial": t.number, "state": t.state, "value": v, "feasible": t.feasible})
        if t.state == TrialState.COMPLETE and t.feasible is not False:
            if current is None or sign * v < sign * current:
                current = v
            best.append({"trial": t.number, "value": current})
    return {
        "kind": "history",
        "study_id": study.id,
        "objective": objs[i],
        "objective_index": i,
        "points": points,
        "best": best,
        "x_label": "trial number",
        "y_label": objs[i]["metric"],
        "title": f"study {study.id}: optimization history",
    }


def _importance_data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    from service.importance import ImportanceError, TooFewTrials, importance

    try:
        r = importance(session, study, o.target, o.evaluator)
        bars = [{"param": k, "importance": v} for k, v in r.importances.items()]
        target, n, note = r.target, r.n_trials, None
    except TooFewTrials as e:  # like the other kinds while a study runs: an empty plot
        bars, n, note = [], e.have, e.message
        target = o.target or study.spec.get("objectives", [{}])[0].get("metric", "value")
    except ImportanceError as e:
        raise PlotError(e.field, e.message) from None
    return {
        "kind": "importance",
        "target": target,
        "evaluator": o.evaluator,
        "n_trials": n,
        "bars": bars,
        "note": note,
        "x_label": f"importance ({o.evaluator})",
        "y_label": "",
        "title": f"study {study.id}: parameter importance for {target} ({n} trials)",
    }


_KINDS = {
    "metric": _metric_data,
    "scatter": _scatter_data,
    "phase": _phase_data,
    "pareto": _pareto_data,
    "history": _history_data,
    "importance": _importance_data,
}


def plot_data(session: Session, study: Study, kind: str, options: PlotOptions) -> dict[str, Any]:
    """The JSON-ready data of one plot; raises PlotError naming a bad query parameter."""
    if kind not in _KINDS:
        raise PlotError("kind", f"unknown plot kind {kind!r}; one of {', '.join(PLOT_KINDS)}")
    return _KINDS[kind](session, study, options)


# ---- rendering (matplotlib, imported here only) -----------------------------------------------

CLASS_STYLE: dict[str, tuple[str, str]] = {  # colour, marker
    "healthy": ("#2ca02c", "o"),
    "entropy_collapse": ("#ff7f0e", "^"),
    "rank_collapse": ("#9467bd", "v"),
    "both": ("#d62728", "s"),
    "diverged": ("#000000", "X"),
    "trapped": ("#bcbd22", "D"),
}
STATE_COLOR = {"COMPLETE": "#1f77b4", "PRUNED": "#7f7f7f", "DIVERGED": "#000000"}


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _positions(values: list[Any]) -> tuple[list[float], list[str] | None]:
    """Numbers as they are; anything else as category positions 0..k-1 with tick labels."""
    if all(_is_number(v) for v in values):
        return [float(v) for v in values], None
    cats = sorted({str(v) for v in values})
    index = {c: i for i, c in enumerate(cats)}
    return [float(index[str(v)]) for v in values], cats


def _set_axis(ax: Any, which: str, ticks: list[str] | None, log: bool) -> None:
    if ticks is not None:
        getattr(ax, f"set_{which}ticks")(range(len(ticks)), ticks)
        getattr(ax, f"set_{which}lim")(-0.5, len(ticks) - 0.5)
    elif log:
        getattr(ax, f"set_{which}scale")("log")


def _draw_metric(ax: Any, data: dict[str, Any]) -> None:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    trials = data["trials"]
    styles = ["-", "--", ":", "-."]
    for s in data["series"]:
        idx = trials.index(s["trial"]) if s["trial"] in trials else 0
        parts = [f"trial {s['trial']}"]
        if s["layer"] is not None:
            parts.append(f"L{s['layer']}")
        if s["head"] is not None:
            parts.append(f"H{s['head']}")
        xs = [st for st, v in zip(s["steps"], s["values"], strict=True) if v is not None]
        ys = [v for v in s["values"] if v is not None]
        ax.plot(
            xs,
            ys,
            color=cmap(idx % 10),
            linestyle=styles[(s["layer"] or 0) % len(styles)],
            marker="." if len(xs) < 30 else None,
            label=" ".join(parts),
        )
    if len(data["series"]) <= 24:
        ax.legend(fontsize="small", ncols=2 if len(data["series"]) > 8 else 1)


def _draw_scatter(fig: Any, ax: Any, data: dict[str, Any]) -> None:
    pts = data["points"]
    xs, xticks = _positions([p["x"] for p in pts])
    ys = [float(p["y"]) for p in pts]
    colors = [p["color"] for p in pts]
    if data["color"] is None:
        ax.scatter(xs, ys, color="#1f77b4", edgecolors="k", linewidths=0.4)
    elif all(_is_number(c) for c in colors):
        from matplotlib.colors import LogNorm

        log = bool(data.get("color_log")) and min(colors) > 0
        sc = ax.scatter(
            xs,
            ys,
            c=[float(c) for c in colors],
            cmap="viridis",
            norm=LogNorm() if log else None,
            edgecolors="k",
            linewidths=0.4,
        )
        fig.colorbar(sc, ax=ax, label=data["color"])
    else:
        from matplotlib import colormaps

        cmap = colormaps["tab10"]
        cats = sorted({str(c) for c in colors})
        for i, cat in enumerate(cats):
            sel = [j for j, c in enumerate(colors) if str(c) == cat]
            ax.scatter(
                [xs[j] for j in sel],
                [ys[j] for j in sel],
                color=cmap(i % 10),
                edgecolors="k",
                linewidths=0.4,
                label=f"{data['color']}={cat}",
            )
        ax.legend(fontsize="small")
    _set_axis(ax, "x", xticks, data["x_log"])
    _set_axis(ax, "y", None, data["y_log"])


def _draw_phase(ax: Any, data: dict[str, Any]) -> None:
    pts = data["points"]
    xs, xticks = _positions([p["x"] for p in pts])
    ys, yticks = _positions([p["y"] for p in pts])
    for cls in data["classes"]:
        sel = [i for i, p in enumerate(pts) if p["class"] == cls]
        if not sel:
            continue
        color, marker = CLASS_STYLE[cls]
        ax.scatter(
            [xs[i] for i in sel],
            [ys[i] for i in sel],
            color=color,
            marker=marker,
            s=48,
            edgecolors="k",
            linewidths=0.4,
            label=f"{cls.replace('_', ' ')} ({len(sel)})",
        )
    ax.legend(fontsize="small", loc="best")
    _set_axis(ax, "x", xticks, data["x_log"])
    _set_axis(ax, "y", yticks, data["y_log"])


def _draw_pareto(ax: Any, data: dict[str, Any]) -> None:
    pts = data["points"]
    if len(data["objectives"]) == 1:
        groups = (
            ("trials", [p for p in pts if not p["on_front"] and p["feasible"] is not False], None),
            (
                "infeasible",
                [p for p in pts if not p["on_front"] and p["feasible"] is False],
                "none",
            ),
        )
        for label, sel, face in groups:
            if sel:
                ax.scatter(
                    [p["rank"] for p in sel],
                    [p["values"][0] for p in sel],
                    color="#1f77b4",
                    facecolors=face,
                    s=30,
                    label=f"{label} ({len(sel)})",
                )
        for p in pts:
            if p["on_front"]:
                ax.scatter(
                    [p["rank"]],
                    [p["values"][0]],
                    color="#d62728",
                    marker="*",
                    s=200,
                    zorder=3,
                    label=f"best: trial {p['trial']}",
                )
        ax.legend(fontsize="small")
        return
    xi, yi = data["x_objective"], data["y_objective"]
    front = sorted((p for p in pts if p["on_front"]), key=lambda p: p["values"][xi])
    for label, sel, face in (
        ("dominated", [p for p in pts if not p["on_front"] and p["feasible"] is not False], None),
        ("infeasible", [p for p in pts if not p["on_front"] and p["feasible"] is False], "none"),
    ):
        if sel:
            ax.scatter(
                [p["values"][xi] for p in sel],
                [p["values"][yi] for p in sel],
                color="#7f7f7f",
                facecolors=face,
                s=24,
                label=f"{label} ({len(sel)})",
            )
    ax.plot(
        [p["values"][xi] for p in front],
        [p["values"][yi] for p in front],
        color="#d62728",
        marker="o",
        label=f"Pareto front ({len(front)})",
        zorder=3,
    )
    ax.legend(fontsize="small")


def _draw_history(ax: Any, data: dict[str, Any]) -> None:
    for state, color in STATE_COLOR.items():
        for infeasible in (False, True):
            sel = [
                p
                for p in data["points"]
                if p["state"] == state and (p["feasible"] is False) == infeasible
            ]
            if sel:
                ax.scatter(
                    [p["trial"] for p in sel],
                    [p["value"] for p in sel],
                    color=color,
                    facecolors="none" if infeasible else None,
                    s=24,
                    label=state.lower() + (" (infeasible)" if infeasible else ""),
                )
    if data["best"]:
        ax.step(
            [b["trial"] for b in data["best"]],
            [b["value"] for b in data["best"]],
            where="post",
            color="#d62728",
            label="best so far",
        )
    if data["points"]:
        ax.legend(fontsize="small")


def _draw_importance(ax: Any, data: dict[str, Any]) -> None:
    bars = list(reversed(data["bars"]))  # largest on top
    ax.barh([b["param"] for b in bars], [b["importance"] for b in bars], color="#1f77b4")
    for i, b in enumerate(bars):
        ax.text(b["importance"], i, f" {b['importance']:.3f}", va="center", fontsize="small")


def _empty(data: dict[str, Any]) -> bool:
    return not (data.get("series") or data.get("points") or data.get("bars"))


def render_png(data: dict[str, Any], width: int = 900, height: int = 600, dpi: int = 100) -> bytes:
    """`width` x `height` pixels of PNG drawing `data` (from `plot_data`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(data.get("title", ""))
    ax.set_xlabel(data.get("x_label", ""))
    ax.set_ylabel(data.get("y_label", ""))
    if _empty(data):
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    else:
        kind = data["kind"]
        if kind == "metric":
            _draw_metric(ax, data)
        elif kind == "scatter":
            _draw_scatter(fig, ax, data)
        elif kind == "phase":
            _draw_phase(ax, data)
        elif kind == "pareto":
            _draw_pareto(ax, data)
        elif kind == "importance":
            _draw_importance(ax, data)
        else:
            _draw_history(ax, data)
    ax.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
