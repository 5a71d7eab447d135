"""The results queries: trial lists with filters, metric series and study summaries."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, select
from sqlalchemy.orm import Session

from service.db.models import NO_INDEX, Metric, Study, Trial, TrialState

__all__ = [
    "SORTABLE",
    "QueryError",
    "TrialFilter",
    "list_trials",
    "metric_series",
    "parse_filter",
    "study_summary",
]

SORTABLE: dict[str, Any] = {
    "number": Trial.number,
    "value": Trial.value,
    "final_val_loss": Trial.final_val_loss,
    "min_norm_entropy": Trial.min_norm_entropy,
    "final_rank_ratio": Trial.final_rank_ratio,
    "qk_eig_var": Trial.qk_eig_var,
    "plateau_steps": Trial.plateau_steps,
    "duration_s": Trial.duration_s,
    "started_at": Trial.started_at,
}
_OPS = {">=": "__ge__", "<=": "__le__", ">": "__gt__", "<": "__lt__", "=": "__eq__"}
_FILTER_RE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<|=)\s*(.+?)\s*$")


class QueryError(ValueError):
    """A bad query parameter, with the parameter's name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


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
    filters: list[TrialFilter] | None = None,
    sort: str = "number",
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[Trial], int]:
    """A page of a study's trials and the total that match."""
    where = [Trial.study_id == study_id]
    if states:
        where.append(Trial.state.in_(states))
    where += [f.clause() for f in filters or []]
    total = s.scalar(select(func.count()).select_from(Trial).where(and_(*where))) or 0
    rows = s.scalars(
        select(Trial)
        .where(and_(*where))
        .order_by(_sort_column(sort), Trial.number)
        .limit(limit)
        .offset(offset)
    ).all()
    return list(rows), int(total)


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
) -> list[Metric]:
    """A trial's metric rows, ordered for plotting (name, layer, head, step)."""
    q = select(Metric).where(Metric.trial_id == trial_id)
    if names:
        q = q.where(Metric.name.in_(names))
    if layer is not None:
        q = q.where(Metric.layer == layer)
    if head is not None:
        q = q.where(Metric.head == head)
    if step_min is not None:
        q = q.where(Metric.step >= step_min)
    if step_max is not None:
        q = q.where(Metric.step <= step_max)
    q = q.order_by(Metric.name, Metric.layer, Metric.head, Metric.step).limit(limit)
    return list(s.scalars(q).all())


def index_or_none(v: int) -> int | None:
    return None if v == NO_INDEX else v


def _count_true(col: Any) -> Any:
    """Portable count of true values (PostgreSQL cannot cast boolean to float)."""
    return func.sum(case((col.is_(True), 1), else_=0))


def study_summary(s: Session, study: Study) -> dict[str, Any]:
    """Counts by state, collapse rates, best value, progress and a naive ETA."""
    counts = dict(
        s.execute(
            select(Trial.state, func.count())
            .where(Trial.study_id == study.id)
            .group_by(Trial.state)
        ).all()
    )
    by_state = {st.value: int(counts.get(st.value, 0)) for st in TrialState}
    finished_states = [TrialState.COMPLETE, TrialState.PRUNED, TrialState.DIVERGED]
    agg = s.execute(
        select(
            func.count(),
            _count_true(Trial.entropy_collapse),
            _count_true(Trial.rank_collapse),
            _count_true(Trial.trapped),
            func.avg(Trial.duration_s),
        ).where(Trial.study_id == study.id, Trial.state.in_(finished_states))
    ).one()
    n_measured = int(agg[0] or 0)
    directions = [o["direction"] for o in study.spec.get("objectives", [{}])]
    best_q = select(Trial).where(
        Trial.study_id == study.id,
        Trial.state == TrialState.COMPLETE,
        Trial.value.is_not(None),
        Trial.feasible.is_not(False),  # the same "best" as /best: feasible trials only
    )
    best_col = Trial.value.desc() if directions[:1] == ["maximize"] else Trial.value.asc()
    best = s.scalars(best_q.order_by(best_col).limit(1)).first()
    done = sum(by_state[k] for k in by_state if k != TrialState.RUNNING)
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
        "updated_at": datetime.now().astimezone().isoformat(),
    }
