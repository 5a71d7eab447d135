"""What fencing costs a runner's writes: the same transactions with and without the fence.

Every write a study runner makes starts with its fence (service/store/fence.py): a
conditional no-op UPDATE of the study row, `WHERE job_attempts = <its attempt>`, in the
same transaction. This measures the runner's two commonest writes through the real store,
fenced (a runner's `Store(sessions, Fence(...))`) and unfenced (`Store(sessions)`, as
before), alternating so that both see the same machine:

- `store_reports`: one batch of metric rows (a 12-layer, 12-head evaluation: 594 rows);
- `record_starts`: one small update of a trial row (where a fixed cost weighs most).

Figures: median and p90 milliseconds per transaction, and fenced / unfenced.

    python -m bench.archive.fence_cost            # ~1 minute
    python -m bench.archive.fence_cost --quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench._common import (
    busy_note,
    load1,
    machine_line,
    percentile,
    pg_available,
    pg_database,
    say,
    table,
)
from service.spec import StudySpec
from service.store import (
    Fence,
    MetricRow,
    StartRow,
    Store,
    make_engine,
    make_sessionmaker,
    upgrade_schema,
)

ROWS_PER_BATCH = 12 * 12 * 4 + 13 + 5  # per-head metrics, rank ratios, scalars


def _batch(row_id: int, step: int) -> list[MetricRow]:
    rows: list[MetricRow] = []
    for name in ("attn_entropy", "attn_entropy_norm", "qk_eig_var", "qk_eig_mean"):
        rows += [
            (row_id, step, name, layer, head, 0.5) for layer in range(12) for head in range(12)
        ]
    rows += [(row_id, step, "rank_ratio", layer, None, 0.5) for layer in range(13)]
    rows += [
        (row_id, step, n, None, None, 1.0)
        for n in ("train_loss", "val_loss", "grad_norm", "lr", "reg_penalty")
    ]
    assert len(rows) == ROWS_PER_BATCH
    return rows


def measure(url: str, reps: int) -> list[list[object]]:
    upgrade_schema(url)
    engine = make_engine(url)
    try:
        sessions = make_sessionmaker(engine)
        plain = Store(sessions)
        spec = StudySpec.model_validate({"name": "fence-cost", "budget": {"n_trials": 1}})
        row, _ = plain.studies.create(spec)
        attempt, _ = plain.studies.claim_launch(row.id, None, lambda i, a: f"bench-{i}-a{a}") or (
            0,
            "",
        )
        assert attempt is not None
        fenced = Store(sessions, Fence(row.id, attempt))
        trial = plain.trials.insert_queued(row.id, 0, {}, 0)
        step = 0

        def reports(store: Store) -> None:
            nonlocal step
            step += 1
            store.trials.store_reports(_batch(trial, step))

        def starts(store: Store) -> None:
            nonlocal step
            step += 1
            store.trials.record_starts({trial: StartRow(f"node-{step}", step, None)})

        out: list[list[object]] = []
        for what, write in (("store_reports (594 rows)", reports), ("record_starts", starts)):
            times: dict[str, list[float]] = {"plain": [], "fenced": []}
            for i in range(reps):
                for kind, store in (("plain", plain), ("fenced", fenced))[:: 1 if i % 2 else -1]:
                    times[kind].append(_time(write, store))
            p, f = times["plain"], times["fenced"]
            out.append(
                [
                    what,
                    1000 * statistics.median(p),
                    1000 * percentile(p, 90),
                    1000 * statistics.median(f),
                    1000 * percentile(f, 90),
                    statistics.median(f) / statistics.median(p),
                ]
            )
        return out
    finally:
        engine.dispose()


def _time(fn: Callable[[Store], None], store: Store) -> float:
    t0 = time.perf_counter()
    fn(store)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200, help="transactions of each kind")
    parser.add_argument("--quick", action="store_true", help="20 transactions of each kind")
    args = parser.parse_args(argv)
    reps = 20 if args.quick else args.reps
    load = load1()
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        say("SQLite ...")
        rows += [["SQLite", *r] for r in measure(f"sqlite:///{Path(tmp) / 'fence.db'}", reps)]
    if (why := pg_available()) is None:
        say("PostgreSQL ...")
        with pg_database("qkscope_fence") as url:
            rows += [["PostgreSQL", *r] for r in measure(url, reps)]
    else:
        say(f"PostgreSQL skipped: {why}")
    header = ["database", "write", "plain ms p50", "p90", "fenced ms p50", "p90", "fenced/plain"]
    print(table(header, rows, title=f"Fencing: cost per transaction ({reps} of each)"))
    print(f"\n{machine_line()}")
    if note := busy_note(load):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
