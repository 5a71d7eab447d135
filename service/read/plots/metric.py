"""`metric` plot: one per-step metric (`metric=`, default `val_loss`) for chosen trials
(`trials=3,7`; default: the best few COMPLETE trials, or the latest trials while none has
completed), narrowed with `layer=` / `head=`; one line per (trial, layer, head).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.read.plots.common import (
    DEFAULT_TRIALS,
    KNOWN_METRICS,
    LAYER_METRICS,
    MAX_TRIALS,
    METRIC_NAME,
    NUMBER,
    SCALAR_METRICS,
    PlotError,
    PlotOptions,
    finite,
    objectives_of,
)
from service.read.summaries import trials_with_bounded_summaries
from service.store import NO_INDEX, Metric, Study, Trial, TrialState

__all__ = ["KIND", "data", "draw", "default_metric_trials"]

KIND = "metric"


def _parse_trials(raw: str) -> list[int]:
    out: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if not NUMBER.fullmatch(part):
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
    direction = objectives_of(study)[0]["direction"]
    order = Trial.value.desc() if direction == "maximize" else Trial.value.asc()
    best = trials_with_bounded_summaries(
        session,
        select(Trial)
        .where(
            Trial.study_id == study.id,
            Trial.state == TrialState.COMPLETE,
            Trial.value.is_not(None),
            Trial.feasible.is_not(False),
        )
        .order_by(order, Trial.number)
        .limit(n),
    )
    if best:
        return list(best)
    latest = trials_with_bounded_summaries(
        session,
        select(Trial).where(Trial.study_id == study.id).order_by(Trial.number.desc()).limit(n),
    )
    return sorted(latest, key=lambda t: t.number)


def _check_metric(session: Session, study: Study, metric: str, o: PlotOptions) -> None:
    if not METRIC_NAME.fullmatch(metric):
        raise PlotError("metric", f"{metric!r} is not a metric name (letters, digits and _)")
    if metric in SCALAR_METRICS and (o.layer is not None or o.head is not None):
        raise PlotError("layer" if o.layer is not None else "head", f"{metric} has no layer/head")
    if metric in LAYER_METRICS and o.head is not None:
        raise PlotError("head", f"{metric} is measured per layer, not per head")
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


def _chosen_trials(session: Session, study: Study, o: PlotOptions) -> list[Trial]:
    """The trials `o.trials` names (all must exist), else the default pick."""
    if not o.trials:
        return list(default_metric_trials(session, study))
    numbers = _parse_trials(o.trials)
    found = trials_with_bounded_summaries(
        session, select(Trial).where(Trial.study_id == study.id, Trial.number.in_(numbers))
    )
    by_number = {t.number: t for t in found}
    missing = [n for n in numbers if n not in by_number]
    if missing:
        raise PlotError(
            "trials", f"no trial number {', '.join(map(str, missing))} in study {study.id}"
        )
    return [by_number[n] for n in numbers]


def _series(
    session: Session, chosen: list[Trial], metric: str, o: PlotOptions
) -> list[dict[str, Any]]:
    """One series per (trial, layer, head), in the chosen trials' order."""
    if not chosen:
        return []
    q = select(Metric).where(Metric.trial_id.in_([t.id for t in chosen]), Metric.name == metric)
    if o.layer is not None:
        q = q.where(Metric.layer == o.layer)
    if o.head is not None:
        q = q.where(Metric.head == o.head)
    rows = session.scalars(q.order_by(Metric.trial_id, Metric.layer, Metric.head, Metric.step))
    grouped: dict[tuple[int, int, int], list[Metric]] = {}
    for r in rows.all():
        grouped.setdefault((r.trial_id, r.layer, r.head), []).append(r)
    number_of = {t.id: t.number for t in chosen}
    rank = {t.id: i for i, t in enumerate(chosen)}
    return [
        {
            "trial": number_of[tid],
            "trial_id": tid,
            "layer": None if layer == NO_INDEX else layer,
            "head": None if head == NO_INDEX else head,
            "steps": [p.step for p in pts],
            "values": [finite(p.value) for p in pts],
        }
        for (tid, layer, head), pts in sorted(
            grouped.items(), key=lambda kv: (rank[kv[0][0]], kv[0][1], kv[0][2])
        )
    ]


def data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    metric = o.metric or "val_loss"
    _check_metric(session, study, metric, o)
    chosen = _chosen_trials(session, study, o)
    return {
        "kind": "metric",
        "study_id": study.id,
        "metric": metric,
        "layer": o.layer,
        "head": o.head,
        "trials": [t.number for t in chosen],
        "series": _series(session, chosen, metric, o),
        "x_label": "step",
        "y_label": metric,
        "title": f"study {study.id}: {metric}",
    }


def draw(fig: Any, ax: Any, data: dict[str, Any]) -> None:
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
