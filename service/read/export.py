"""A study's results as tables, streamed: CSV, Parquet, or a zip of both tables.

Two tables:

- trials: one row per trial; the study's id and name, the trial's columns, the provenance of
  its summary (`config_hash`, `code_commit`), its summary numbers and flags, its collapse
  class, and one `params.<path>` column per parameter;
- metrics: the long table of every stored metric value: `number` (the trial number),
  `trial_id`, `name`, `layer`, `head` (empty where the metric has none), `step`, `value`.

In CSV, a string cell that a spreadsheet would take for a formula (=, +, -, @, tab, CR at
its start; not a number literal such as -3) is written with a leading single quote
(`neutralise`); Parquet holds the strings as they are.

Both are read in batches by key (keyset pagination: trials by number, a trial's metric
rows by (name, layer, head, step)), each batch in its own short transaction on a pooled
connection that goes back to the pool before the batch is written, and written batch by
batch (a CSV chunk, a Parquet row group, a zip deflate block). So memory stays flat however
many metric rows a study has, and a slow download holds no connection while the client reads:
many of them cannot starve the pool the API's other requests need. A study that is still
running is read as it is at each batch, not as one snapshot.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service.read.export_formats import (
    FORMULA_STARTS,
    Batches,
    Counting,
    Sink,
    Table,
    neutralise,
    write_csv,
    write_parquet,
)
from service.read.plots import collapse_class
from service.read.queries import MetricKey, metric_series
from service.read.summaries import trials_with_bounded_summaries
from service.store import NO_INDEX, SUMMARY_COLUMNS, Study, Trial, session_scope
from workers.metric_names import SUMMARIES

__all__ = [
    "BATCH_ROWS",
    "FORMULA_STARTS",
    "MEDIA_TYPES",
    "METRIC_COLUMNS",
    "ExportFormat",
    "export_stream",
    "neutralise",
    "trial_columns",
]

ExportFormat = Literal["csv", "parquet"]
BATCH_ROWS = 20_000

# (column, arrow type name) of the fixed part of the trials table, in order.
_BASE = [
    ("study_id", "int64"),
    ("study_name", "string"),
    ("trial_id", "int64"),
    ("number", "int64"),
    ("state", "string"),
    ("value", "float64"),
]
_AFTER_VALUES = [
    ("feasible", "bool"),
    ("seed", "int64"),
    ("attempts", "int64"),
    ("node", "string"),
    ("last_step", "int64"),
    ("penalty_version", "int64"),
    # provenance, from the trial's summary (workers/provenance.py): its config and code
    ("config_hash", "string"),
    ("code_commit", "string"),
    ("metric_rows", "int64"),
    ("started_at", "timestamp"),
    ("finished_at", "timestamp"),
    ("duration_s", "float64"),
    ("error", "string"),
    ("stop_reason", "string"),  # why a PRUNED trial stopped
    ("status", "string"),  # the trial summary's status: completed, pruned, diverged
]
# Every summary metric of the registry, typed as it says, then the collapse class.
_ARROW_TYPE = {"float": "float64", "int": "int64", "bool": "bool"}
_SUMMARY = [(m.name, _ARROW_TYPE[m.type]) for m in SUMMARIES] + [("collapse_class", "string")]
_TRIAL_ATTRS = {"value", "feasible", "seed", "attempts", "node", "last_step", "metric_rows"}
_TRIAL_ATTRS |= {"penalty_version"}
_TRIAL_ATTRS |= {"started_at", "finished_at", "duration_s", "error", "state", "number"}
_TRIAL_ATTRS |= {"stop_reason"}
_SUMMARY_COLUMNS_ON_TRIAL = set(SUMMARY_COLUMNS)
METRIC_COLUMNS = [
    ("number", "int64"),
    ("trial_id", "int64"),
    ("name", "string"),
    ("layer", "int64"),
    ("head", "int64"),
    ("step", "int64"),
    ("value", "float64"),
]


# ---- the trials table --------------------------------------------------------------------------


def _param_type(values: list[Any]) -> str:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "bool"
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return "int64"
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return "float64"
    if not present:
        return "float64"
    return "string"


def _param_columns(session: Session, study: Study) -> list[tuple[str, str]]:
    """One column per search-space path (then any other key found), typed by its values."""
    seen: dict[str, list[Any]] = {p: [] for p in study.spec.get("search_space", {})}
    for params in session.scalars(select(Trial.params).where(Trial.study_id == study.id)):
        for k, v in (params or {}).items():
            seen.setdefault(k, []).append(v)
    return [(f"params.{k}", _param_type(v)) for k, v in seen.items()]


def trial_columns(session: Session, study: Study) -> list[tuple[str, str]]:
    """(name, type) of every column of the study's trials table, in order."""
    n_obj = len(study.spec.get("objectives") or [{}])
    values = [(f"values.{i}", "float64") for i in range(n_obj)] if n_obj > 1 else []
    return _BASE + values + _AFTER_VALUES + _SUMMARY + _param_columns(session, study)


def _trial_row(t: Trial, columns: list[tuple[str, str]], study_name: str) -> list[Any]:
    summary = t.summary or {}
    row: list[Any] = []
    for name, kind in columns:
        v: Any
        if name == "study_id":
            v = t.study_id
        elif name == "study_name":
            v = study_name
        elif name == "trial_id":
            v = t.id
        elif name.startswith("values."):
            i = int(name.removeprefix("values."))
            v = t.values[i] if t.values and i < len(t.values) else None
        elif name.startswith("params."):
            v = (t.params or {}).get(name.removeprefix("params."))
            if kind == "string" and v is not None and not isinstance(v, str):
                v = json.dumps(v)
        elif name == "collapse_class":
            v = collapse_class(t)
        elif name == "status":
            v = summary.get("status")
        elif name in _TRIAL_ATTRS or name in _SUMMARY_COLUMNS_ON_TRIAL:
            v = getattr(t, name)
            if v is None and name in _SUMMARY_COLUMNS_ON_TRIAL:
                v = summary.get(name)
        else:
            v = summary.get(name)
        if v is not None and kind == "int64" and isinstance(v, float) and v.is_integer():
            v = int(v)
        if v is not None and kind == "float64" and not isinstance(v, bool):
            v = float(v)
        row.append(v)
    return row


def _trial_batches(
    sessions: sessionmaker[Session],
    study_id: int,
    columns: list[tuple[str, str]],
    batch: int,
    study_name: str,
) -> Batches:
    def batches() -> Iterator[list[list[Any]]]:
        after = -1
        while True:
            with session_scope(sessions) as session:
                q = (
                    select(Trial)
                    .where(Trial.study_id == study_id, Trial.number > after)
                    .order_by(Trial.number)
                    .limit(batch)
                )
                # each summary bounded by the database: not its per-evaluation lists
                trials = trials_with_bounded_summaries(session, q)
                rows = [(t.number, _trial_row(t, columns, study_name)) for t in trials]
            if not rows:
                return
            after = rows[-1][0]
            yield [r for _, r in rows]
            if len(rows) < batch:
                return

    return batches


# ---- the metrics table -------------------------------------------------------------------------


def _metric_batches(sessions: sessionmaker[Session], study_id: int, batch: int) -> Batches:
    def batches() -> Iterator[list[list[Any]]]:
        with session_scope(sessions) as session:
            trials = session.execute(
                select(Trial.number, Trial.id)
                .where(Trial.study_id == study_id)
                .order_by(Trial.number)
            ).all()
        rows: list[list[Any]] = []
        for number, trial_id in trials:
            # Per trial, in primary-key order from where the last read stopped: an index
            # range scan, no sort of the whole study, no offset to skip.
            start: MetricKey | None = None
            while True:
                with session_scope(sessions) as session:
                    got = metric_series(session, trial_id, limit=batch + 1, start=start)
                for name, layer, head, step, value in got[:batch]:
                    rows.append(
                        [
                            number,
                            trial_id,
                            name,
                            None if layer == NO_INDEX else layer,
                            None if head == NO_INDEX else head,
                            step,
                            value,
                        ]
                    )
                    if len(rows) >= batch:
                        yield rows
                        rows = []
                if len(got) <= batch:
                    break
                nxt = got[batch]
                start = (nxt.name, nxt.layer, nxt.head, nxt.step)
        if rows:
            yield rows

    return batches


# ---- writers ------------------------------------------------------------------------------------


_WRITERS = {"csv": write_csv, "parquet": write_parquet}
MEDIA_TYPES = {"csv": "text/csv; charset=utf-8", "parquet": "application/vnd.apache.parquet"}


def export_plan(
    sessions: sessionmaker[Session],
    study_id: int,
    what: Literal["trials", "metrics", "both"],
    batch: int,
) -> list[Table]:
    """The tables to write, their columns read now (one short transaction); LookupError for
    a study that does not exist."""
    tables = []
    with session_scope(sessions) as session:
        study = session.get(Study, study_id)
        if study is None:
            raise LookupError(f"study {study_id} does not exist")
        cols = trial_columns(session, study) if what in ("trials", "both") else []
        name = study.name
    if what in ("trials", "both"):
        batches = _trial_batches(sessions, study_id, cols, batch, name)
        tables.append(Table("trials", cols, batches))
    if what in ("metrics", "both"):
        tables.append(Table("metrics", METRIC_COLUMNS, _metric_batches(sessions, study_id, batch)))
    return tables


def export_stream(
    sessions: sessionmaker[Session],
    study_id: int,
    fmt: ExportFormat,
    what: Literal["trials", "metrics", "both"],
    *,
    batch: int = BATCH_ROWS,
) -> Iterator[bytes]:
    """The bytes of one table (`what` = trials or metrics) or of a zip holding both tables
    (`what` = both: trials.<fmt> and metrics.<fmt>), chunk by chunk.

    Every read is its own short transaction from `sessions` (none is open while a chunk is
    handed to the caller), so it can run after the request's session is gone and a slow
    reader holds no connection; the study must exist."""
    sink = Sink()
    write = _WRITERS[fmt]
    tables = export_plan(sessions, study_id, what, batch)
    if what != "both":
        for _ in write(tables[0], sink):
            if chunk := sink.drain():
                yield chunk
        return
    stamp = datetime.now(UTC).timetuple()[:6]
    method = zipfile.ZIP_DEFLATED if fmt == "csv" else zipfile.ZIP_STORED
    with zipfile.ZipFile(sink, "w") as zf:
        for table in tables:
            info = zipfile.ZipInfo(f"{table.name}.{fmt}", date_time=stamp)
            info.compress_type = method
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as member:
                for _ in write(table, Counting(member)):
                    if chunk := sink.drain():
                        yield chunk
    if chunk := sink.drain():
        yield chunk
