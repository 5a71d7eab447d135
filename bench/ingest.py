"""Metric ingestion: qkscope's real report path against a bare bulk insert, side by side.

qkscope path: Ray tasks report evaluations through `workers.inbox.InboxReporter` to a
`TrialInbox` actor; the driver plays the study runner's loop (wait `service.runner.loop.POLL_S`,
drain the inbox, `Reports.store` (service/runner/reports.py), which writes one transaction per batch via
`service.store.ingest.insert_metrics`). The StudyRunner is the real one, built on a real study
row. Reports are shaped like a 12-layer, 12-head model's evaluation (4 per-head metrics,
13 rank ratios, 5 scalars: 594 rows; `--layers/--heads` to change).

Baseline: the very same rows, in the same batches, one transaction per batch, written bare:
PostgreSQL `COPY qk_metric FROM STDIN` through psycopg; SQLite `executemany` of a plain
INSERT on a raw sqlite3 connection with the same pragmas.

Figures: end-to-end rows/s (first report sent -> last row committed), the runner's write
rows/s (rows / time spent in `persist_reports`), the bare rows/s, and their ratios.
Goal: >= 50,000 rows/s into PostgreSQL, within 2x of the bare baseline.

    python -m bench.ingest            # ~1-2 minutes
    python -m bench.ingest --quick
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from sqlalchemy import func, select

from bench._common import (
    busy_note,
    load1,
    machine_line,
    pg_available,
    pg_database,
    say,
    table,
)

GOAL_PG_ROWS_S = 50_000
GOAL_RATIO = 0.5  # within 2x of the bare insert

SPEC: dict[str, Any] = {
    "name": "bench-ingest",
    "base": {
        "task": {"kind": "associative_recall", "seq_len": 24, "n_symbols": 16, "n_pairs": 6},
        "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
        "steps": 100,
        "eval_every": 50,
    },
    "search_space": {"regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0}},
    "sampler": {"kind": "random", "seed": 0},
    "budget": {"n_trials": 1000},
}


def eval_points(layers: int, heads: int, step: int) -> list[Any]:
    """One evaluation's MetricPoints, shaped like workers.trial.probe_metrics' output."""
    from workers.metric_names import series_by_index
    from workers.trial import MetricPoint

    pts = [
        MetricPoint("train_loss", 2.0 / step),
        MetricPoint("val_loss", 2.1 / step),
        MetricPoint("grad_norm", 0.5),
        MetricPoint("lr", 1e-3),
        MetricPoint("reg_penalty", 0.01),
    ]
    for layer in range(layers):
        for head in range(heads):
            for name in series_by_index("head"):
                pts.append(MetricPoint(name, 0.1 + 0.01 * head + 0.001 * step, layer, head))
    pts += [MetricPoint("rank_ratio", 1.0 / (1 + layer), layer) for layer in range(layers + 1)]
    return pts


@ray.remote(num_cpus=1)
def produce(
    inbox: Any, trial: int, n_reports: int, layers: int, heads: int, first_step: int
) -> tuple[int, float]:
    """A trial task's reporting, minus the training: report `n_reports` evaluations."""
    from workers.inbox import InboxReporter

    reporter = InboxReporter(inbox, trial)
    sent = 0
    t0 = time.perf_counter()
    for i in range(n_reports):
        step = first_step + (i + 1) * 50
        pts = eval_points(layers, heads, step)
        reporter.report(step, pts, None)
        sent += len(pts)
    reporter.flush()
    return sent, time.perf_counter() - t0


@dataclass
class Run:
    rows: int
    e2e_s: float
    write_s: float
    produce_s: float  # the slowest reporting task's own time
    batches: list[int] = field(default_factory=list)


class Harness:
    """A real StudyRunner on a real study row, with trials registered as if launched."""

    def __init__(self, url: str, home: Path) -> None:
        from service.config import Settings
        from service.runner.loop import StudyRunner
        from service.runner.reports import Reports
        from service.spec import StudySpec
        from service.store import StudyRows, make_engine, make_sessionmaker, upgrade_schema

        upgrade_schema(url)
        self.url = url
        self.engine = make_engine(url)
        self.sessions = make_sessionmaker(self.engine)
        settings = Settings(database_url=url, home=home)
        row, _ = StudyRows(self.sessions).create(StudySpec.model_validate(SPEC))
        self.runner = StudyRunner(row.id, settings, self.engine)
        self.study_id = row.id
        self.records: dict[int, Any] = {}
        r = self.runner
        self.reports = Reports(r.spec, r.store.trials, r.search, lambda number, reason: None)

    def new_trial(self) -> tuple[int, int]:
        """Ask Optuna, insert the qk_trial row, hold its record as the runner's scheduler does."""
        from service.runner.records import TrialRecord

        trial = self.runner.search.study.ask()
        row_id = self.runner.store.trials.insert_queued(self.study_id, trial.number, {}, 0)
        self.records[trial.number] = TrialRecord(trial, row_id, {}, None)
        return trial.number, row_id

    def metric_count(self) -> int:
        from service.store import Metric, session_scope

        with session_scope(self.sessions) as s:
            return int(s.scalar(select(func.count()).select_from(Metric)) or 0)

    def run_qkscope(self, producers: int, n_reports: int, layers: int, heads: int) -> Run:
        """Producers report through the inbox; this thread plays the runner's loop."""
        from service.runner.loop import POLL_S
        from workers.inbox import TrialInboxActor

        inbox = TrialInboxActor.remote()  # type: ignore[attr-defined]
        numbers = [self.new_trial()[0] for _ in range(producers)]
        before = self.metric_count()
        t0 = time.perf_counter()
        refs = [produce.remote(inbox, n, n_reports, layers, heads, 0) for n in numbers]
        pending = list(refs)
        write_s = 0.0
        batches: list[int] = []
        while True:
            if pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            reports = ray.get(inbox.drain.remote()).reports
            if reports:
                tw = time.perf_counter()
                self.reports.store([(m, self.records[m.trial]) for m in reports])
                write_s += time.perf_counter() - tw
                batches.append(sum(len(m.points) for m in reports))
            elif not pending:
                break
        e2e = time.perf_counter() - t0
        done = ray.get(refs)
        sent = sum(n for n, _ in done)
        stored = self.metric_count() - before
        if stored != sent:
            raise RuntimeError(f"sent {sent} metric rows but {stored} were stored")
        return Run(sent, e2e, write_s, max(t for _, t in done), batches)

    def bare_rows(self, batches: list[int], layers: int, heads: int) -> list[list[tuple[Any, ...]]]:
        """The same rows, in the same batch sizes, for fresh trials (no key conflicts)."""
        _, row_id = self.new_trial()
        out: list[list[tuple[Any, ...]]] = []
        step = 0
        pending: list[tuple[Any, ...]] = []
        for size in batches:
            while len(pending) < size:
                step += 50
                for p in eval_points(layers, heads, step):
                    pending.append(
                        (
                            row_id,
                            p.name,
                            -1 if p.layer is None else p.layer,
                            -1 if p.head is None else p.head,
                            step,
                            p.value,
                        )
                    )
            out.append(pending[:size])
            pending = pending[size:]
        return out

    def run_bare(self, batches: list[list[tuple[Any, ...]]]) -> float:
        """Seconds to write every batch bare, one transaction (commit) each."""
        cols = "(trial_id, name, layer, head, step, value)"
        if self.url.startswith("sqlite"):
            conn = sqlite3.connect(self.url.removeprefix("sqlite:///"), timeout=30)
            for pragma in (
                "journal_mode=WAL",
                "busy_timeout=30000",
                "foreign_keys=ON",
                "synchronous=NORMAL",
            ):
                conn.execute(f"PRAGMA {pragma}")
            t0 = time.perf_counter()
            for b in batches:
                conn.executemany(f"INSERT INTO qk_metric {cols} VALUES (?, ?, ?, ?, ?, ?)", b)
                conn.commit()
            took = time.perf_counter() - t0
            conn.close()
            return took
        import psycopg

        with psycopg.connect(self.url) as conn:
            t0 = time.perf_counter()
            for b in batches:
                with conn.cursor() as cur, cur.copy(f"COPY qk_metric {cols} FROM STDIN") as cp:
                    for r in b:
                        cp.write_row(r)
                conn.commit()
            return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.dispose()


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    per_report = len(eval_points(args.layers, args.heads, 50))
    n_reports = max(1, args.rows // (per_report * args.producers))
    with tempfile.TemporaryDirectory(prefix="qkscope-bench-ingest-") as home:
        h = Harness(url, Path(home))
        try:
            h.run_qkscope(args.producers, 3, args.layers, args.heads)  # warm-up: workers, caches
            q_runs: list[Run] = []
            bare_s: list[float] = []
            bare_rows: list[int] = []
            for rep in range(args.repeats):  # ABBA: qkscope, bare, bare, qkscope, ...
                first_q = rep % 2 == 0
                if first_q:
                    q_runs.append(h.run_qkscope(args.producers, n_reports, args.layers, args.heads))
                batches = h.bare_rows(
                    q_runs[-1].batches if q_runs else [per_report * n_reports * args.producers],
                    args.layers,
                    args.heads,
                )
                bare_s.append(h.run_bare(batches))
                bare_rows.append(sum(len(b) for b in batches))
                if not first_q:
                    q_runs.append(h.run_qkscope(args.producers, n_reports, args.layers, args.heads))
        finally:
            h.close()
    med = statistics.median
    e2e = med(r.rows / r.e2e_s for r in q_runs)
    write = med(r.rows / r.write_s for r in q_runs)
    report = med(r.rows / r.produce_s for r in q_runs)
    bare = med(n / s for n, s in zip(bare_rows, bare_s, strict=True))
    return {
        "rows": q_runs[0].rows,
        "batch": med(b for r in q_runs for b in r.batches),
        "e2e": e2e,
        "write": write,
        "report": report,
        "bare": bare,
        "repeats": len(q_runs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 60k rows, 1 repeat")
    p.add_argument("--rows", type=int, default=None, help="metric rows per run (default 300k)")
    p.add_argument("--repeats", type=int, default=None, help="runs of each side (default 2)")
    p.add_argument("--producers", type=int, default=2, help="reporting Ray tasks (default 2)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--db", default="postgresql,sqlite", help="comma-separated: postgresql,sqlite")
    args = p.parse_args(argv)
    args.rows = args.rows or (60_000 if args.quick else 300_000)
    args.repeats = args.repeats or (1 if args.quick else 2)
    load0 = load1()
    t_start = time.perf_counter()
    ray.init(
        address="local",  # a fresh cluster of our own, never someone's `ray start` head
        num_cpus=max(2, args.producers),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    results: list[tuple[str, dict[str, Any]]] = []
    notes: list[str] = []
    try:
        for db in [d.strip() for d in args.db.split(",") if d.strip()]:
            if db == "postgresql":
                problem = pg_available()
                if problem:
                    notes.append(f"PostgreSQL skipped: {problem}")
                    continue
                with pg_database("qkscope_bench_ingest") as url:
                    say(f"ingest: PostgreSQL {args.rows:,} rows x {args.repeats} ...")
                    results.append(("PostgreSQL", measure(url, args)))
            else:
                with tempfile.TemporaryDirectory(prefix="qkscope-bench-sqlite-") as d:
                    say(f"ingest: SQLite {args.rows:,} rows x {args.repeats} ...")
                    results.append(("SQLite", measure(f"sqlite:///{d}/bench.db", args)))
    finally:
        ray.shutdown()
    from service.runner.loop import POLL_S

    per_report = len(eval_points(args.layers, args.heads, 50))
    print(f"ingest: {machine_line()}")
    print(
        f"reports of {per_report} rows ({args.layers} layers x {args.heads} heads), "
        f"{args.producers} reporting tasks, runner poll {POLL_S} s; median of {args.repeats} "
        "interleaved runs"
    )
    rows = [
        [
            name,
            r["rows"],
            r["batch"],
            r["report"],
            r["e2e"],
            r["write"],
            r["bare"],
            r["e2e"] / r["bare"],
            r["write"] / r["bare"],
        ]
        for name, r in results
    ]
    print(
        table(
            [
                "database",
                "rows/run",
                "median batch",
                "reporting rows/s",
                "qkscope e2e rows/s",
                "runner write rows/s",
                "bare rows/s",
                "e2e / bare",
                "write / bare",
            ],
            rows,
        )
    )
    for name, r in results:
        if name == "PostgreSQL":
            ok_abs = r["e2e"] >= GOAL_PG_ROWS_S
            ok_ratio = r["write"] / r["bare"] >= GOAL_RATIO
            print(
                f"goal (PostgreSQL): e2e >= {GOAL_PG_ROWS_S:,} rows/s: "
                f"{'met' if ok_abs else 'NOT met'} ({r['e2e']:,.0f}); runner write within 2x of "
                f"bare: {'met' if ok_ratio else 'NOT met'} ({r['write'] / r['bare']:.2f})"
            )
    for n in notes:
        print(f"note: {n}")
    if w := busy_note(load0):
        print(w)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
