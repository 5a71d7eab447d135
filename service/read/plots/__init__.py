"""Plots of a study's results: the data behind each plot, and its PNG.

One module per kind, each with its data and its drawing together (`KIND`, `data`, `draw`):
`metric`, `scatter`, `phase`, `pareto`, `history`, `importance` (see each module's docstring
for its query parameters); `common` holds what they share. Two entry points:

- `plot_data(session, study, kind, options)` reads the database and returns plain,
  JSON-ready dicts (no matplotlib involved), so the data can be served and tested alone;
- `render_png(data, width, height)` draws that dict with matplotlib's Agg backend
  (object API only, no pyplot state, no display). matplotlib is imported inside the
  rendering function, so importing this package, or the API, stays light.
"""

from __future__ import annotations

import io
from types import ModuleType
from typing import Any

from sqlalchemy.orm import Session

from service.read.plots import history, importance, metric, pareto, phase, scatter
from service.read.plots.common import (
    COLLAPSE_CLASSES,
    DEFAULT_TRIALS,
    KNOWN_METRICS,
    MAX_TRIALS,
    PlotError,
    PlotOptions,
    collapse_class,
    field_value,
)
from service.read.plots.pareto import pareto_front
from service.store import Study

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

_KINDS: dict[str, ModuleType] = {
    m.KIND: m for m in (metric, scatter, phase, pareto, history, importance)
}
PLOT_KINDS = tuple(_KINDS)


def plot_data(session: Session, study: Study, kind: str, options: PlotOptions) -> dict[str, Any]:
    """The JSON-ready data of one plot; raises PlotError naming a bad query parameter."""
    if kind not in _KINDS:
        raise PlotError("kind", f"unknown plot kind {kind!r}; one of {', '.join(PLOT_KINDS)}")
    data: dict[str, Any] = _KINDS[kind].data(session, study, options)
    return data


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
        note = data.get("note") or "no data yet"
        ax.text(0.5, 0.5, note, ha="center", va="center", wrap=True, transform=ax.transAxes)
    else:
        _KINDS[data["kind"]].draw(fig, ax, data)
    ax.grid(True, alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
