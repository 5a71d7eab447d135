"""`pareto` plot: the Pareto front of COMPLETE trials over all objectives, drawn on two of them
(`x=`/`y=` name objective metrics; default the first two); for a single objective, every
COMPLETE trial ranked by its value with the best one marked.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.read.plots.common import (
    NUMBER,
    PlotError,
    PlotOptions,
    objectives_of,
    trial_rows,
    values_of,
)
from service.store import Study, TrialState

__all__ = ["KIND", "data", "draw", "pareto_front"]

KIND = "pareto"


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


def _objective_index(objs: list[dict[str, str]], name: str | None, default: int, q: str) -> int:
    if name is None:
        return default
    metrics = [ob["metric"] for ob in objs]
    if NUMBER.fullmatch(name) and int(name) < len(objs):
        return int(name)
    if name in metrics:
        return metrics.index(name)
    raise PlotError(q, f"{name!r} is not an objective of this study (objectives: {metrics})")


def data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    objs = objectives_of(study)
    directions = [ob["direction"] for ob in objs]
    complete = [
        t
        for t in trial_rows(session, study, (), (TrialState.COMPLETE,))
        if len(values_of(t)) == len(objs) and None not in values_of(t)
    ]
    cands = {
        t.number: [float(v) for v in values_of(t) if v is not None]
        for t in complete
        if not o.feasible_only or t.feasible is not False
    }
    front = pareto_front(cands, directions)
    points: list[dict[str, Any]] = [
        {
            "trial": t.number,
            "values": values_of(t),
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


def draw(fig: Any, ax: Any, data: dict[str, Any]) -> None:
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
