"""`importance` plot: the search-space parameters ranked by importance for `target=` (an objective
or summary metric) with `evaluator=` fanova (default) or ped_anova (service.read.importance); empty,
with a note saying how many trials it needs, until enough trials have completed. The ranking
comes from the app's ImportanceCache (PlotOptions.importance_cache), shared with /importance, so
it is recomputed only after another trial completes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service.read.plots.common import PlotOptions
from service.store import Study

__all__ = ["KIND", "data", "draw"]

KIND = "importance"


def data(session: Session, study: Study, o: PlotOptions) -> dict[str, Any]:
    from service.read.importance import TooFewTrials, importance

    try:
        if o.importance_cache is not None:  # reused until another trial completes
            r = o.importance_cache.get(session, study, o.target, o.evaluator)
        else:
            r = importance(session, study, o.target, o.evaluator)
        bars = [{"param": k, "importance": v} for k, v in r.importances.items()]
        target, n, note = r.target, r.n_trials, None
    except TooFewTrials as e:  # like the other kinds while a study runs: an empty plot
        bars, n, note = [], e.have, e.message
        target = o.target or study.spec.get("objectives", [{}])[0].get("metric", "value")
    # Any other bad target/evaluator is an InvalidField (service/errors.py) like PlotError: a 422.
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


def draw(fig: Any, ax: Any, data: dict[str, Any]) -> None:
    bars = list(reversed(data["bars"]))  # largest on top
    ax.barh([b["param"] for b in bars], [b["importance"] for b in bars], color="#1f77b4")
    ax.set_xlim(0, max(b["importance"] for b in bars) * 1.15 or 1.0)  # room for the labels
    for i, b in enumerate(bars):
        ax.text(b["importance"], i, f" {b['importance']:.3f}", va="center", fontsize="small")
