"""The results queries: trial lists with filters, metric series and study summaries."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Float, Row, and_, case, func, literal, select, text, tuple_
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.orm import Session, defer
from sqlalchemy.types import Text

from service.errors import InvalidField
from service.store import (
    INF,
    NEG_INF,
    NO_INDEX,
    OPEN_TRIAL_STATES,
    SUMMARY_COLUMNS,
    Metric,
    Study,
    Trial,
    TrialState,
)
from workers.metric_names import FLAG_SUMMARIES, SUMMARY_NAMES

__all__ = [
    "SORTABLE",
    "MetricKey",
    "QueryError",
    "TrialFilter",
    "list_trials",
    "metric_series",
    "metric_series_json",
    "parse_filter",
    "stored_metric_names",
    "study_summary",
]


def _summary_field(name: str) -> Any:
    """A summary metric's own column, else its number in the trial's summary JSON, where an
    infinity is the string "inf" (service/store/nonfinite.py): read as the float on both
    databases (SQLite would cast the text to 0), so that it sorts above every number and
    `max_attn_logit_ever<=50` leaves it out."""
    if name in SUMMARY_COLUMNS:
        return getattr(Trial, name)
    text_value = Trial.summary[name].as_string()
    return case(
        (text_value == INF, literal(math.inf, Float)),
        (text_value == NEG_INF, literal(-math.inf, Float)),
        else_=Trial.summary[name].as_float(),
    )


# Fields `where=` and `sort=` accept besides params.<path>: the trial's own numbers and
# every summary metric of the registry (workers.metric_names), flags included.
SORTABLE: dict[str, Any] = {
    "number": Trial.number,
    "value": Trial.value,
    **{name: _summary_field(name) for name in SUMMARY_NAMES},
    "penalty_version": Trial.penalty_version,
    "duration_s": Trial.duration_s,
    "started_at": Trial.started_at,
}
FLAGS = frozenset(FLAG_SUMMARIES)
_OPS = {">=": "__ge__", "<=": "__le__", ">": "__gt__", "<": "__lt__", "=": "__eq__"}
_FILTER_RE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<|=)\s*(.+?)\s*$")


QueryError = InvalidField  # a bad query parameter, named (a 422: service/errors.py)


@dataclass(frozen=True)
class TrialFilter:
    field: str
    op: str
    value: float

    def clause(self) -> ColumnElement[bool]:
        if self.field.startswith("params."):
            col: Any = Trial.params[self.field.removeprefix("params.")].as_float()
        else:
            col = SORTABLE[self.field]
        if self.field in FLAGS:  # `trapped=1`: a flag compares with true (1) or false (0)
            return col.is_(self.value == 1.0)  # type: ignore[no-any-return]
        return getattr(col, _OPS[self.op])(self.value)  # type: ignore[no-any-return]


def parse_filter(expr: str) -> TrialFilter:
    """`min_norm_entropy>=0.1` or `params.regularizer.lambda<0.01`."""
    m = _FILTER_RE.match(expr)
    if m is None:
        raise QueryError(
            "where", f"cannot parse {expr!r}; expected FIELD OP NUMBER, OP one of >=, <=, >, <, ="
        )
    field, op, raw = m.groups()
    if field not in SORTABLE and not field.startswith("params."):
        raise QueryError(
            "where", f"unknown field {field!r}; use params.<name> or one of {sorted(SORTABLE)}"
        )
    try:
        value = float(raw)
    except ValueError:
        raise QueryError("where", f"{raw!r} is not a number") from None
    if field in FLAGS and (op != "=" or value not in (0.0, 1.0)):
        raise QueryError("where", f"{field} is a flag: use {field}=1 (true) or {field}=0 (false)")
    return TrialFilter(field, op, value)


def _sort_column(sort: str) -> Any:
    desc = sort.startswith("-")
    name = sort.lstrip("-+")
    if name.startswith("params."):
        col: Any = Trial.params[name.removeprefix("params.")].as_float()
    elif name in SORTABLE:
        col = SORTABLE[name]
    else:
        raise QueryError(
            "sort", f"unknown field {name!r}; use params.<name> or one of {sorted(SORTABLE)}"
        )
    return (col.desc() if desc else col.asc()).nulls_last()


def list_trials(
    s: Session,
    study_id: int,
    *,
    states: list[str] | None = None,
    penalty_versions: list[int] | None = None,
    filters: list[TrialFilter] | None = None,
    sort: str = "number",
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Trial], int]:
    """A page of a study's trials and the total that match.

    Two narrow steps instead of count + wide sort: first the page's ids with the total as a
    window count (filter, sort and count touch only the ids and sort keys), then the 50
    full rows by primary key. A page past the end (no ids, offset > 0) counts separately.
    """
    where = [Trial.study_id == study_id]
    if states:
        where.append(Trial.state.in_(states))
    if penalty_versions:
        where.append(Trial.penalty_version.in_(penalty_versions))
    where += [f.clause() for f in filters or []]
    page = s.execute(
        select(Trial.id, func.count().over())
        .where(and_(*where))
        .order_by(_sort_column(sort), Trial.number)
        .limit(limit)
        .offset(offset)
    ).all()
    if not page:
        if offset == 0:
            return [], 0
        total = s.scalar(select(func.count()).select_from(Trial).where(and_(*where))) or 0
        return [], int(total)
    ids = [row[0] for row in page]
    # without their summaries (a list page shows none; a long trial's is hundreds of KiB)
    rows = s.scalars(select(Trial).where(Trial.id.in_(ids)).options(defer(Trial.summary)))
    by_id = {t.id: t for t in rows}
    return [by_id[i] for i in ids], int(page[0][1])


# Where a page of a trial's metric rows starts: (name, layer, head, step) as stored (layer and
# head NO_INDEX where the metric has none), the order of the rows and of the primary key.
MetricKey = tuple[str, int, int, int]


def _series_filter(
    trial_id: int,
    names: list[str] | None,
    layer: int | None,
    head: int | None,
    step_min: int | None,
    step_max: int | None,
    start: MetricKey | None = None,
) -> list[ColumnElement[bool]]:
    """The WHERE of a trial's metric rows, by the /series and /metrics query parameters;
    with `start`, only the rows from that key on (keyset paging: a primary-key range scan,
    however deep the page)."""
    where = [Metric.trial_id == trial_id]
    if names:
        where.append(Metric.name.in_(names))
    if layer is not None:
        where.append(Metric.layer == layer)
    if head is not None:
        where.append(Metric.head == head)
    if step_min is not None:
        where.append(Metric.step >= step_min)
    if step_max is not None:
        where.append(Metric.step <= step_max)
    if start is not None:
        where.append(_key() >= tuple_(trial_id, *start))
    return where


def _key() -> Any:
    """The metric row's primary key as one row value, for keyset comparisons."""
    return tuple_(Metric.trial_id, Metric.name, Metric.layer, Metric.head, Metric.step)


def metric_series(
    s: Session,
    trial_id: int,
    *,
    names: list[str] | None = None,
    layer: int | None = None,
    head: int | None = None,
    step_min: int | None = None,
    step_max: int | None = None,
    limit: int = 100_000,
    start: MetricKey | None = None,
) -> list[Row[str, int, int, int, float | None]]:
    """A trial's metric rows, ordered for plotting (name, layer, head, step), at most
    `limit`, from the key `start` on.

    Plain rows with the attributes `name`, `layer`, `head`, `step`, `value`, not ORM
    objects: a series is thousands of rows, and building (and garbage-collecting) an
    identity-mapped entity for each roughly doubled the time of a 1,000-row read.
    """
    where = _series_filter(trial_id, names, layer, head, step_min, step_max, start)
    q = select(Metric.name, Metric.layer, Metric.head, Metric.step, Metric.value).where(*where)
    q = q.order_by(Metric.name, Metric.layer, Metric.head, Metric.step).limit(limit)
    return list(s.execute(q).all())


def metric_series_json(
    s: Session,
    trial_id: int,
    *,
    names: list[str] | None = None,
    step_min: int | None = None,
    step_max: int | None = None,
    limit: int,
    start: MetricKey | None = None,
) -> tuple[int, str, MetricKey | None] | None:
    """On PostgreSQL: a page of at most `limit` of a trial's metric rows (from the key
    `start` on), grouped by (name, layer, head) and written as the JSON list of
    /v1/trials/{id}/series by the database (json_agg per series), with the row count and
    the key the next page starts at (None: this was the last); None elsewhere (SQLite writes
    reals with 15 digits: not the stored double).

    The page's end is found first (the key `limit` rows on: an index-only scan), so the
    database never aggregates more than `limit` rows. 100,000 rows: ~0.09 s instead of ~0.3 s
    for fetching them as rows and grouping here (the database builds ~100 strings, not
    Python 100,000 tuples).
    """
    if s.get_bind().dialect.name != "postgresql":
        return None
    s.execute(text("SET LOCAL extra_float_digits = 1"))  # shortest text that reads back exact
    where = _series_filter(trial_id, names, None, None, step_min, step_max, start)
    end = s.execute(
        select(Metric.name, Metric.layer, Metric.head, Metric.step)
        .where(*where)
        .order_by(Metric.name, Metric.layer, Metric.head, Metric.step)
        .offset(limit)
        .limit(1)
    ).first()
    next_start: MetricKey | None = None
    if end is not None:
        next_start = (str(end[0]), int(end[1]), int(end[2]), int(end[3]))
        where.append(_key() < tuple_(trial_id, *next_start))
    q = select(
        Metric.name,
        Metric.layer,
        Metric.head,
        func.count(),
        func.json_agg(aggregate_order_by(Metric.step, Metric.step)).cast(Text),
        func.json_agg(aggregate_order_by(Metric.value, Metric.step)).cast(Text),
    ).where(*where)
    q = q.group_by(Metric.name, Metric.layer, Metric.head)
    q = q.order_by(Metric.name, Metric.layer, Metric.head)
    groups = s.execute(q).all()
    rows = sum(int(g[3]) for g in groups)

    def index(v: int) -> str:
        return "null" if v == NO_INDEX else str(int(v))

    # json_agg writes "[1, 2]"; the lists hold numbers and nulls only, so the spaces can go.
    parts = [
        f'{{"name":{json.dumps(n)},"layer":{index(ly)},"head":{index(hd)},'
        f'"steps":{steps.replace(", ", ",")},"values":{values.replace(", ", ",")}}}'
        for n, ly, hd, _, steps, values in groups
    ]
    return rows, "[" + ",".join(parts) + "]", next_start


def stored_metric_names(s: Session, trial_id: int, names: list[str]) -> set[str]:
    """Which of `names` the trial has rows of (one index probe per name)."""
    return {
        n
        for n in names
        if s.scalar(
            select(Metric.step).where(Metric.trial_id == trial_id, Metric.name == n).limit(1)
        )
        is not None
    }


def index_or_none(v: int) -> int | None:
    return None if v == NO_INDEX else v


def _count_true(col: Any) -> Any:
    """Portable count of true values (PostgreSQL cannot cast boolean to float)."""
    return func.sum(case((col.is_(True), 1), else_=0))


def _best_trial(s: Session, study: Study) -> Trial | None:
    """The COMPLETE trial with the best value, in the first objective's direction."""
    directions = [o["direction"] for o in study.spec.get("objectives", [{}])]
    best_q = select(Trial).where(
        Trial.study_id == study.id,
        Trial.state == TrialState.COMPLETE,
        Trial.value.is_not(None),
        Trial.feasible.is_not(False),  # the same "best" as /best: feasible trials only
    )
    best_col = Trial.value.desc() if directions[:1] == ["maximize"] else Trial.value.asc()
    best_q = best_q.options(defer(Trial.summary))  # only its id, value and params are shown
    return s.scalars(best_q.order_by(best_col).limit(1)).first()


def study_summary(s: Session, study: Study) -> dict[str, Any]:
    """Counts by state, collapse rates, best value, progress and a naive ETA."""
    # One pass over the study's trials: per state, the count and the sums the rates and
    # the ETA need; finished states are added up here rather than in a second scan.
    per_state = s.execute(
        select(
            Trial.state,
            func.count(),
            _count_true(Trial.entropy_collapse),
            _count_true(Trial.rank_collapse),
            _count_true(Trial.trapped),
            func.sum(Trial.duration_s),
            func.count(Trial.duration_s),
        )
        .where(Trial.study_id == study.id)
        .group_by(Trial.state)
    ).all()
    counts = {row[0]: int(row[1]) for row in per_state}
    by_state = {st.value: int(counts.get(st.value, 0)) for st in TrialState}
    finished_states = {TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED}
    finished = [row for row in per_state if row[0] in finished_states]
    n_measured = sum(int(row[1]) for row in finished)
    n_timed = sum(int(row[6] or 0) for row in finished)
    agg = (
        n_measured,
        sum(int(row[2] or 0) for row in finished),
        sum(int(row[3] or 0) for row in finished),
        sum(int(row[4] or 0) for row in finished),
        sum(float(row[5] or 0.0) for row in finished) / n_timed if n_timed else None,
    )
    best = _best_trial(s, study)
    done = sum(by_state[k] for k in by_state if k not in OPEN_TRIAL_STATES)
    eta = None
    parallel = int(study.spec.get("parallelism", 1))
    if agg[4] is not None and study.status == "RUNNING":
        eta = max(0.0, (study.n_trials - done) * float(agg[4]) / max(1, parallel))

    def rate(x: Any) -> float | None:
        return None if n_measured == 0 else float(x or 0) / n_measured

    return {
        "study_id": study.id,
        "status": study.status,
        "n_trials": study.n_trials,
        "trials_by_state": by_state,
        "finished": done,
        "progress": done / study.n_trials if study.n_trials else 0.0,
        "entropy_collapse_rate": rate(agg[1]),
        "rank_collapse_rate": rate(agg[2]),
        "trapped_rate": rate(agg[3]),
        "best_value": best.value if best else None,
        "best_trial_id": best.id if best else None,
        "best_params": best.params if best else None,
        "eta_s": eta,
        "waiting_reason": study.waiting_reason,  # why nothing starts (no node fits, no Ray)
        "updated_at": datetime.now().astimezone().isoformat(),
    }
