"""`scatter` plot: a summary metric (`y=`, default the first objective's metric) against a
parameter or metric (`x=params.<path>`, default the first search-space parameter), coloured by a
third (`color=`, default the second search-space parameter; `none`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.read.plots.common import (
    MEASURED,
    PlotError,
    PlotOptions,
    check_field,
    default_params,
    field_value,
    is_log,
    is_number,
    objectives_of,
    positions,
    set_axis,
    trial_rows,
)
from service.store import Study

__all__ = ["KIND", "data", "draw"]

KIND = "scatter"


def data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    defaults = default_params(study, 2)
    x = o.x or (defaults[0] if defaults else None)
    if x is None:
        raise PlotError("x", "this study has no search space: name a field with x=")
    y = o.y or objectives_of(study)[0]["metric"]
    color = o.color if o.color is not None else (defaults[1] if len(defaults) > 1 else None)
    if color in ("", "none"):
        color = None
    check_field(study, x, "x", numeric=False)
    check_field(study, y, "y", numeric=True)
    if color is not None:
        check_field(study, color, "color", numeric=False)
    points = []
    for t in trial_rows(session, study, (x, y, color), MEASURED, objectives=False):
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
        "x_log": is_log(study, x),
        "y_log": is_log(study, y),
        "color_log": color is not None and is_log(study, color),
        "points": points,
        "x_label": x,
        "y_label": y,
        "title": f"study {study.id}: {y} vs {x}",
    }


def draw(fig: Any, ax: Any, data: dict[str, Any]) -> None:
    pts = data["points"]
    xs, xticks = positions([p["x"] for p in pts])
    ys = [float(p["y"]) for p in pts]
    colors = [p["color"] for p in pts]
    if data["color"] is None:
        ax.scatter(xs, ys, color="#1f77b4", edgecolors="k", linewidths=0.4)
    elif all(is_number(c) for c in colors):
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
    set_axis(ax, "x", xticks, data["x_log"])
    set_axis(ax, "y", None, data["y_log"])
