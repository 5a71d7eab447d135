"""`history` plot: the objective value (`objective=` index, default 0) of every trial by trial
number, with the running best of the COMPLETE feasible trials; and `l0`, the ceiling of a loss
axis (the web UI's loss-axis rule, docs/ui.md): the largest over the study's trials of the
validation loss at the trial's first evaluation, which is l_0 (the untrained model, step 0)
where the study evaluates at init.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from service.read.plots.common import (
    STATE_COLOR,
    PlotError,
    PlotOptions,
    objectives_of,
    trial_rows,
    values_of,
)
from service.store import NO_INDEX, Metric, Study, Trial, TrialState

__all__ = ["KIND", "data", "draw", "first_val_loss_max"]

KIND = "history"


def first_val_loss_max(session: Session, study_id: int) -> float | None:
    """The largest over the study's trials of the `val_loss` row at the trial's first
    evaluated step (step 0 with `eval_at_init`: l_0); None when no trial has one."""
    scalar = (Metric.name == "val_loss", Metric.layer == NO_INDEX, Metric.head == NO_INDEX)
    first = (
        select(Metric.trial_id, func.min(Metric.step).label("step"))
        .join(Trial, Trial.id == Metric.trial_id)
        .where(Trial.study_id == study_id, *scalar)
        .group_by(Metric.trial_id)
        .subquery()
    )
    value = session.execute(
        select(func.max(Metric.value))
        .join(first, and_(Metric.trial_id == first.c.trial_id, Metric.step == first.c.step))
        .where(*scalar)
    ).scalar()
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    objs = objectives_of(study)
    if not 0 <= o.objective < len(objs):
        raise PlotError(
            "objective", f"this study has {len(objs)} objective(s): use 0..{len(objs) - 1}"
        )
    i = o.objective
    sign = 1.0 if objs[i]["direction"] == "minimize" else -1.0
    points: list[dict[str, Any]] = []
    best: list[dict[str, Any]] = []
    current: float | None = None
    for t in trial_rows(session, study):
        vals = values_of(t)
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
        "l0": first_val_loss_max(session, study.id),
        "title": f"study {study.id}: optimization history",
    }


def draw(fig: Any, ax: Any, data: dict[str, Any]) -> None:
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
