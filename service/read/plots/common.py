"""What every plot kind shares: the query options, the error type, the fields of a trial
(params, summary columns and metrics, flags, the collapse class) and a few drawing helpers."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from sqlalchemy import Text, cast, select
from sqlalchemy.orm import Session

from service.errors import InvalidField
from service.read.summaries import trials_with_bounded_summaries
from service.store import SUMMARY_COLUMNS, Study, Trial, TrialState, json_number
from workers.metric_names import FLAG_SUMMARIES, NUMERIC_SUMMARIES, series_by_index

if TYPE_CHECKING:
    from service.read.importance import ImportanceCache

__all__ = [
    "CATEGORY_FIELDS",
    "CLASS_STYLE",
    "COLLAPSE_CLASSES",
    "COLUMNS",
    "DEFAULT_TRIALS",
    "FLAG_FIELDS",
    "HEAD_METRICS",
    "KNOWN_METRICS",
    "LAYER_METRICS",
    "MAX_TRIALS",
    "MEASURED",
    "METRIC_NAME",
    "NUMBER",
    "NUMERIC_FIELDS",
    "PlotError",
    "PlotOptions",
    "SCALAR_METRICS",
    "STATE_COLOR",
    "TABLE_COLUMNS",
    "check_field",
    "collapse_class",
    "default_params",
    "field_value",
    "finite",
    "is_log",
    "is_number",
    "objectives_of",
    "param_is_numeric",
    "positions",
    "search_space",
    "set_axis",
    "trial_rows",
    "trials_of",
    "values_of",
]

COLLAPSE_CLASSES = ("healthy", "entropy_collapse", "rank_collapse", "both", "diverged", "trapped")
# Metric names the trials write (the registry's series), by what they are indexed by.
SCALAR_METRICS = series_by_index("none")
LAYER_METRICS = series_by_index("layer")
HEAD_METRICS = series_by_index("head")
KNOWN_METRICS = SCALAR_METRICS + LAYER_METRICS + HEAD_METRICS
DEFAULT_TRIALS = 5  # the "best few" of a metric plot
MAX_TRIALS = 20  # trials on one metric plot
MEASURED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED)
# Fields a scatter/phase axis or colour may name besides params.<path>: numbers first.
COLUMNS = (
    "value",
    *(name for name in SUMMARY_COLUMNS if name in NUMERIC_SUMMARIES),
    "penalty_version",
    "duration_s",
    "last_step",
    "number",
)
NUMERIC_FIELDS = tuple(dict.fromkeys((*COLUMNS, *NUMERIC_SUMMARIES)))
FLAG_FIELDS = (*FLAG_SUMMARIES, "feasible")
CATEGORY_FIELDS = ("state", "collapse_class")
METRIC_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII only: str.isdigit() also accepts "²"
TABLE_COLUMNS = frozenset((*COLUMNS, *FLAG_FIELDS, "state"))


PlotError = InvalidField  # a bad query parameter, named (a 422: service/errors.py)


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
    # importance: the app's cache (app.state.importance), shared with /importance; None
    # (a caller without an app) computes the ranking afresh
    importance_cache: ImportanceCache | None = field(default=None, compare=False, repr=False)


def finite(v: Any) -> Any:
    """JSON-safe: NaN and infinities become None; bools and strings pass through."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def collapse_class(t: Any) -> str | None:
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


def field_value(t: Any, name: str) -> Any:
    """A trial's value of `params.<path>`, a summary column or metric, a flag or a category."""
    if name.startswith("params."):
        return finite(t.params.get(name.removeprefix("params.")))
    if name == "collapse_class":
        return collapse_class(t)
    if name in TABLE_COLUMNS:
        return finite(getattr(t, name))
    return finite((t.summary or {}).get(name))


def search_space(study: Study) -> dict[str, dict[str, Any]]:
    space: dict[str, dict[str, Any]] = study.spec.get("search_space", {})
    return space


def param_is_numeric(param: dict[str, Any]) -> bool:
    if param.get("type") in ("float", "int"):
        return True
    if param.get("type") == "fixed":
        v = param.get("value")
        return isinstance(v, int | float) and not isinstance(v, bool)
    return False


def check_field(study: Study, name: str, query: str, *, numeric: bool) -> None:
    """`name` must be a search-space parameter (params.<path>) or a known trial field."""
    if name.startswith("params."):
        path = name.removeprefix("params.")
        space = search_space(study)
        if path not in space:
            known = ", ".join(f"params.{p}" for p in space) or "none"
            raise PlotError(query, f"{path!r} is not in the search space (parameters: {known})")
        if numeric and not param_is_numeric(space[path]):
            raise PlotError(query, f"{name} is categorical; this axis needs a number")
        return
    allowed = NUMERIC_FIELDS if numeric else NUMERIC_FIELDS + FLAG_FIELDS + CATEGORY_FIELDS
    if name not in allowed:
        raise PlotError(
            query, f"unknown field {name!r}; use params.<path> or one of {', '.join(allowed)}"
        )


def is_log(study: Study, name: str) -> bool:
    if not name.startswith("params."):
        return False
    return bool(search_space(study).get(name.removeprefix("params."), {}).get("log", False))


def default_params(study: Study, n: int) -> list[str]:
    return [f"params.{p}" for p in list(search_space(study))[:n]]


def objectives_of(study: Study) -> list[dict[str, str]]:
    objs: list[dict[str, str]] = study.spec.get("objectives") or [
        {"metric": "final_val_loss", "direction": "minimize"}
    ]
    return [{"metric": o["metric"], "direction": o.get("direction", "minimize")} for o in objs]


def values_of(t: Any) -> list[float | None]:
    if t.values is not None:
        return [finite(float(v)) if v is not None else None for v in t.values]
    return [finite(t.value)]


def trials_of(session: Session, study: Study, states: tuple[str, ...] | None = None) -> list[Trial]:
    q = select(Trial).where(Trial.study_id == study.id)
    if states is not None:
        q = q.where(Trial.state.in_(states))
    return trials_with_bounded_summaries(session, q.order_by(Trial.number))


# What every plot row carries: enough for values_of and the history. JSON columns come as
# text and are decoded here (psycopg's JSON loader costs ~3x more a row).
_ROW_COLUMNS = ("number", "state", "value", "feasible")
_JSON_COLUMNS = ("values",)
_loads = json.JSONDecoder().decode


def _row_columns(
    fields: Iterable[str | None], objectives: bool
) -> tuple[dict[str, Any], list[str], list[str]]:
    """What `trial_rows` selects for `fields`: trial columns by name, JSON columns read
    whole (as text), and the summary keys extracted from the summary JSON."""
    cols: dict[str, Any] = {name: getattr(Trial, name) for name in _ROW_COLUMNS}
    text_cols = list(_JSON_COLUMNS if objectives else ())
    summary_keys: list[str] = []
    for name in fields:
        if name is None or name == "state":
            continue
        if name == "collapse_class":
            cols.update({f: getattr(Trial, f) for f in FLAG_SUMMARIES})
            if "status" not in summary_keys:
                summary_keys.append("status")
        elif name.startswith("params."):
            if "params" not in text_cols:
                text_cols.append("params")  # whole: a few keys, one decode
        elif name in TABLE_COLUMNS:
            cols[name] = getattr(Trial, name)
        elif name not in summary_keys:
            summary_keys.append(name)
    return cols, text_cols, summary_keys


def trial_rows(
    session: Session,
    study: Study,
    fields: Iterable[str | None] = (),
    states: tuple[str, ...] | None = None,
    *,
    objectives: bool = True,
) -> list[Any]:
    """The study's trials by number, as plain rows holding only what a plot reads.

    Each row has the attributes that `collapse_class` (when `fields` names collapse_class),
    `field_value` (for the `fields` named: params.<path>, trial columns, summary metrics) and
    `values_of` (unless `objectives` is false) read: `params` whole (a few keys), and of the
    summary JSON only `status` and the metrics named, extracted by the database. At 10,000
    trials this is several times faster than loading ORM objects with every column and the
    whole summary (its per-evaluation lists) of each trial.
    """
    cols, text_cols, summary_keys = _row_columns(fields, objectives)
    # Summary elements as JSON text ("null" where missing): numbers keep int or float; the
    # status (a string) as text.
    q = select(
        *(c.label(n) for n, c in cols.items()),
        *(cast(getattr(Trial, n), Text).label(n) for n in text_cols),
        *(
            (Trial.summary[k].as_string() if k == "status" else cast(Trial.summary[k], Text)).label(
                f"s{i}"
            )
            for i, k in enumerate(summary_keys)
        ),
    ).where(Trial.study_id == study.id)
    if states is not None:
        q = q.where(Trial.state.in_(states))

    def decode(v: str | None) -> Any:
        return None if v is None or v == "null" else json_number(_loads(v))

    names, k, j = list(cols), len(cols), len(cols) + len(text_cols)
    out = []
    for row in session.execute(q.order_by(Trial.number)):
        t = SimpleNamespace(**dict(zip(names, row[:k], strict=True)))
        for n, v in zip(text_cols, row[k:j], strict=True):
            setattr(t, n, decode(v))
        t.summary = {
            key: v if key == "status" else decode(v)
            for key, v in zip(summary_keys, row[j:], strict=True)
        }
        out.append(t)
    return out


CLASS_STYLE: dict[str, tuple[str, str]] = {  # colour, marker
    "healthy": ("#2ca02c", "o"),
    "entropy_collapse": ("#ff7f0e", "^"),
    "rank_collapse": ("#9467bd", "v"),
    "both": ("#d62728", "s"),
    "diverged": ("#000000", "X"),
    "trapped": ("#bcbd22", "D"),
}


STATE_COLOR = {"COMPLETE": "#1f77b4", "PRUNED": "#7f7f7f", "DIVERGED": "#000000"}


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def positions(values: list[Any]) -> tuple[list[float], list[str] | None]:
    """Numbers as they are; anything else as category positions 0..k-1 with tick labels."""
    if all(is_number(v) for v in values):
        return [float(v) for v in values], None
    cats = sorted({str(v) for v in values})
    index = {c: i for i, c in enumerate(cats)}
    return [float(index[str(v)]) for v in values], cats


def set_axis(ax: Any, which: str, ticks: list[str] | None, log: bool) -> None:
    if ticks is not None:
        getattr(ax, f"set_{which}ticks")(range(len(ticks)), ticks)
        getattr(ax, f"set_{which}lim")(-0.5, len(ticks) - 0.5)
    elif log:
        getattr(ax, f"set_{which}scale")("log")
