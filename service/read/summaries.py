"""Trial summaries as the read routes show them: bounded, whatever the trial's length.

A trial's stored summary keeps one entry per evaluation in `eval_steps` and `val_losses`
(about 251 KiB of JSON at 10,000 evaluations, and the limits allow 10,000 evaluations on
each of 1,111 such trials). Read whole, a request over a study's trials held hundreds of
MiB (`/best` with 300 of them: about 310 MiB; three at once near 1 GiB) for numbers no
route shows. So the read routes never load those lists:

- the database leaves them out before the row leaves it (`bounded_summary`: SQLite's
  `json_remove`, PostgreSQL's jsonb `-`), so a route holds only what it returns;
- the per-evaluation validation loss is a metric series (`val_loss`, one row per
  evaluation): `/v1/trials/{id}/metrics?name=val_loss` (paged) and `/series` serve it;
- `plateaus` (one interval per plateau, few in practice but up to one per two evaluations)
  keeps its last `MAX_PLATEAUS` intervals (the last one is the one `trapped` is about),
  with `plateaus_left_out` saying how many earlier ones were left out; `plateau_count`,
  `plateau_steps` and `longest_plateau` are over all of them.

Routes that need rows without any summary defer the column (`defer(Trial.summary)`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, case, cast, func, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, defer
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import Text

from service.store import Trial, decode_numbers

__all__ = [
    "MAX_PLATEAUS",
    "SERIES_KEYS",
    "bounded_summary",
    "bounded_summaries",
    "decode_summary",
    "trials_with_bounded_summaries",
    "trim",
]

# The summary's per-evaluation lists: left out of every read route (their numbers are the
# `val_loss` metric series).
SERIES_KEYS: tuple[str, ...] = ("eval_steps", "val_losses")
MAX_PLATEAUS = 100  # plateau intervals a read route shows (the last ones)

_loads = json.JSONDecoder().decode


def bounded_summary(session: Session) -> ColumnElement[str | None]:
    """`qk_trial.summary` without `SERIES_KEYS`, as JSON text, computed by the database."""
    if session.get_bind().dialect.name == "postgresql":
        doc = cast(Trial.summary, JSONB)
        expr: Any = doc
        for key in SERIES_KEYS:
            expr = expr.op("-")(key)
        # a summary stored as JSON null (a trial without one) has no keys to remove
        return case((func.jsonb_typeof(doc) == "object", cast(expr, Text)), else_=None)
    paths = [f"$.{key}" for key in SERIES_KEYS]
    return func.json_remove(Trial.summary, *paths, type_=Text)  # type: ignore[no-any-return]


def trim(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """A summary as a read route shows it: without `SERIES_KEYS`, the last `MAX_PLATEAUS`
    plateaus (for a summary read whole elsewhere, e.g. from a worker)."""
    if summary is None:
        return None
    out = {k: v for k, v in summary.items() if k not in SERIES_KEYS}
    plateaus = out.get("plateaus")
    if isinstance(plateaus, list) and len(plateaus) > MAX_PLATEAUS:
        out["plateaus"] = plateaus[-MAX_PLATEAUS:]
        out["plateaus_left_out"] = len(plateaus) - MAX_PLATEAUS
    return out


def decode_summary(text: str | None) -> dict[str, Any] | None:
    """A `bounded_summary` column's text as the summary a read route shows (`trim`), its
    infinities as floats (stored as "inf": service/store/nonfinite.py)."""
    if text is None or text == "null":
        return None
    value = _loads(text)
    return trim(decode_numbers(value)) if isinstance(value, dict) else None


def bounded_summaries(session: Session, trial_ids: Sequence[int]) -> dict[int, Any]:
    """The bounded summary (`trim`) of each trial of `trial_ids`, by id."""
    out: dict[int, Any] = {}
    ids = list(trial_ids)
    for start in range(0, len(ids), 500):  # a bounded IN list
        chunk = ids[start : start + 500]
        q = select(Trial.id, bounded_summary(session)).where(Trial.id.in_(chunk))
        for tid, text in session.execute(q):
            out[int(tid)] = decode_summary(text)
    return out


def trials_with_bounded_summaries(session: Session, query: Select[Any]) -> list[Trial]:
    """The trials `query` selects, each with its bounded summary in `summary` (set as if
    loaded: the read session never writes it back); the whole summary is never loaded."""
    q = query.add_columns(bounded_summary(session)).options(defer(Trial.summary))
    out: list[Trial] = []
    for trial, text in session.execute(q):
        set_committed_value(trial, "summary", decode_summary(text))
        out.append(trial)
    return out
