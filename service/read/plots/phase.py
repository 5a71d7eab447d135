"""`phase` plot: the collapse phase diagram: every measured trial (COMPLETE, PRUNED, DIVERGED) at
(`x`, `y`) (default: the first two search-space parameters), coloured by its collapse class
(`COLLAPSE_CLASSES`, see `common.collapse_class`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.read.plots.common import (
    CLASS_STYLE,
    COLLAPSE_CLASSES,
    MEASURED,
    PlotError,
    PlotOptions,
    check_field,
    collapse_class,
    default_params,
    field_value,
    is_log,
    positions,
    set_axis,
    trial_rows,
)
from service.store import Study

__all__ = ["KIND", "data", "draw"]

KIND = "phase"


def data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    defaults = default_params(study, 2)
    x = o.x or (defaults[0] if defaults else None)
    y = o.y or (defaults[1] if len(defaults) > 1 else None)
    if x is None or y is None:
        raise PlotError(
            "x" if x is None else "y",
            "the search space has fewer than two parameters: name both axes with x= and y=",
        )
    check_field(study, x, "x", numeric=False)
    check_field(study, y, "y", numeric=False)
    points = []
    counts = dict.fromkeys(COLLAPSE_CLASSES, 0)
    for t in trial_rows(session, study, (x, y, "collapse_class"), MEASURED, objectives=False):
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
        "x_log": is_log(study, x),
        "y_log": is_log(study, y),
        "classes": list(COLLAPSE_CLASSES),
        "counts": counts,
        "points": points,
        "x_label": x,
        "y_label": y,
        "title": f"study {study.id}: collapse phase diagram",
    }


def draw(fig: Any, ax: Any, data: dict[str, Any]) -> None:
    pts = data["points"]
    xs, xticks = positions([p["x"] for p in pts])
    ys, yticks = positions([p["y"] for p in pts])
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
    set_axis(ax, "x", xticks, data["x_log"])
    set_axis(ax, "y", yticks, data["y_log"])
