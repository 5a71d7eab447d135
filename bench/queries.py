"""Results-API latency on a big study: qkscope's queries vs Optuna's storage API, same data.

Loads one synthetic study of `--trials` trials (default 10,000) and `--rows` metric rows
(default 10,000,000: 1,000 per trial, a 2-layer 2-head model evaluated ~42 times) into a
throwaway PostgreSQL database through the project's own bulk path
(`service.store.ingest.insert_metrics`), and the same trials (params, values, summary numbers
as user attributes, the val-loss curve as intermediate values) into Optuna's RDBStorage
in the same database. Then times each question many times (p50/p95/p99):

- qkscope, the functions the API routes call (`service.read.queries`, one session per call
  like one request), and the same routes over HTTP (FastAPI TestClient, in process);
- Optuna, the nearest answer its storage API gives: `get_all_trials` then filter/sort in
  Python; `get_trial(...).intermediate_values`; `get_best_trial` + counts by state. Both
  the raw `RDBStorage` (each call reads the database) and a warm `optuna.load_study`
  (its in-process trial cache) are shown.

Goal: p95 < 50 ms for every qkscope query.

    python -m bench.queries                          # full size, several minutes to load
    python -m bench.queries --quick                  # 1,000 trials, 200,000 rows
    python -m bench.queries --trials 2000 --rows 1000000 --keep   # keep the database
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
from workers.metric_names import series_by_index

GOAL_P95_MS = 50.0
LAYERS, HEADS = 2, 2
PER_HEAD = series_by_index("head")  # the metric registry's per-head series
SCALARS = series_by_index("none")
STATES = ["COMPLETE"] * 80 + ["PRUNED"] * 10 + ["DIVERGED"] * 5 + ["FAILED"] * 5

SPEC: dict[str, Any] = {
    "name": "bench-queries",
    "base": {
        "task": {"kind": "associative_recall", "seq_len": 24, "n_symbols": 16, "n_pairs": 6},
        "model": {"n_layers": LAYERS, "n_heads": HEADS, "d_model": 32, "d_ff": 64},
        "steps": 2100,
        "eval_every": 50,
    },
    "search_space": {
        "regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
    },
    "sampler": {"kind": "random", "seed": 0},
    "budget": {"n_trials": 10_000},
    "parallelism": 8,
    "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
    "constraints": [{"metric": "min_norm_entropy", "op": ">=", "value": 0.1}],
}


def eval_points(step: int, rng: random.Random) -> list[tuple[str, int, int, float]]:
    pts = [(n, -1, -1, rng.random() * 3 / (1 + step / 500)) for n in SCALARS]
    for layer in range(LAYERS):
        for head in range(HEADS):
            pts += [(n, layer, head, rng.random()) for n in PER_HEAD]
    pts += [("rank_ratio", layer, -1, rng.random()) for layer in range(LAYERS + 1)]
    return pts


def synth_trial(number: int, rng: random.Random, evals: int) -> dict[str, Any]:
    state = STATES[number % len(STATES)]
    lam = math.exp(rng.uniform(math.log(1e-4), math.log(1.0)))
    std = math.exp(rng.uniform(math.log(0.02), math.log(1.5)))
    finished = state != "FAILED"
    val = rng.uniform(0.5, 3.0) if finished else None
    mne = rng.uniform(0.0, 0.9) if finished else None
    steps = [50 * (i + 1) for i in range(evals)]
    return {
        "number": number,
        "state": state,
        "params": {"regularizer.lambda": lam, "model.qk_init_std": std},
        "value": val if state == "COMPLETE" else None,
        "values": [val] if state == "COMPLETE" else None,
        "feasible": (mne is not None and mne >= 0.1) if finished else None,
        "final_val_loss": val,
        "min_norm_entropy": mne,
        "final_rank_ratio": rng.uniform(0.0, 1.0) if finished else None,
        "qk_eig_var": rng.uniform(0.0, 0.5) if finished else None,
        "plateau_steps": rng.randrange(0, 500) if finished else None,
        "entropy_collapse": (mne is not None and mne < 0.1),
        "rank_collapse": rng.random() < 0.1,
        "trapped": rng.random() < 0.05,
        "duration_s": rng.uniform(5, 50),
        "last_step": steps[-1] if steps else 0,
        "summary": {
            "status": "completed",
            "steps_done": steps[-1] if steps else 0,
            "final_val_loss": val,
            "min_norm_entropy": mne,
            "eval_steps": steps,
            "val_losses": [rng.uniform(0.5, 3.0) for _ in steps],
            "plateaus": [[100, 300]],
        },
        "val_curve": [(s, rng.uniform(0.5, 3.0)) for s in steps],
    }


# ---- loading -------------------------------------------------------------------------------


def load_qkscope(url: str, trials: list[dict[str, Any]], rows_per_trial: int, seed: int) -> Any:
    """Study + trials (bulk INSERT) + metrics (service.store.ingest.insert_metrics, per chunk)."""
    from sqlalchemy import insert

    from service.store import (
        Study,
        Trial,
        insert_metrics,
        make_engine,
        make_sessionmaker,
        session_scope,
        upgrade_schema,
    )

    upgrade_schema(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    with session_scope(sessions) as s:
        study = Study(
            name=SPEC["name"],
            status="RUNNING",
            spec=SPEC,
            n_trials=len(trials),
            optuna_study_name="bench-queries",
        )
        s.add(study)
        s.flush()
        study_id = study.id
    cols = {c.name for c in Trial.__table__.columns}
    t0 = time.perf_counter()
    with session_scope(sessions) as s:
        for i in range(0, len(trials), 2000):
            chunk = [
                {k: v for k, v in t.items() if k in cols} | {"study_id": study_id}
                for t in trials[i : i + 2000]
            ]
            s.execute(insert(Trial), chunk)
    with session_scope(sessions) as s:
        from sqlalchemy import select

        ids = list(
            s.scalars(select(Trial.id).where(Trial.study_id == study_id).order_by(Trial.number))
        )
    trial_s = time.perf_counter() - t0
    rng = random.Random(seed)
    total = 0
    t0 = time.perf_counter()
    chunk_rows: list[dict[str, Any]] = []
    evals = math.ceil(rows_per_trial / len(eval_points(50, rng)))
    for n, tid in enumerate(ids):
        made = 0
        for e in range(evals):
            step = 50 * (e + 1)
            for name, layer, head, value in eval_points(step, rng):
                if made == rows_per_trial:
                    break
                chunk_rows.append(
                    {"trial_id": tid, "name": name, "step": step, "layer": layer,
                     "head": head, "value": value}
                )  # fmt: skip
                made += 1
        if len(chunk_rows) >= 500_000 or n == len(ids) - 1:
            with session_scope(sessions) as s:
                insert_metrics(s, chunk_rows)
            total += len(chunk_rows)
            chunk_rows = []
            el = time.perf_counter() - t0
            say(f"  metrics: {total:,} rows in {el:.0f} s ({total / el:,.0f} rows/s)")
    metric_s = time.perf_counter() - t0
    from sqlalchemy import text

    # What autovacuum would have done by the time anyone reads a study this size: fresh
    # planner statistics and a visibility map (index-only scans).
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE" if url.startswith("postgresql") else "ANALYZE"))
    return (
        engine,
        sessions,
        study_id,
        ids,
        {"trials_s": trial_s, "metrics_s": metric_s, "rows": total},
    )


def load_optuna(url: str, trials: list[dict[str, Any]]) -> tuple[str, float]:
    """The same trials in Optuna's own tables, bulk-inserted through Optuna's ORM models.

    (One `study.add_trials` per trial, Optuna's public path, runs at ~25 trials/s here:
    minutes for 10,000. The rows written are the ones it would write; a trial added through
    the public API first checks the format.)
    """
    import json
    from datetime import datetime

    import optuna
    from optuna.distributions import FloatDistribution, distribution_to_json
    from optuna.storages._rdb import models as om
    from optuna.trial import TrialState, create_trial
    from sqlalchemy import create_engine, insert, select

    from service.store import normalize_url

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(normalize_url(url))
    study = optuna.create_study(storage=storage, study_name="optuna-bench", direction="minimize")
    dists = {
        "regularizer.lambda": FloatDistribution(1e-4, 1.0, log=True),
        "model.qk_init_std": FloatDistribution(0.02, 1.5, log=True),
    }
    state_map = {
        "COMPLETE": TrialState.COMPLETE,
        "PRUNED": TrialState.PRUNED,
        "DIVERGED": TrialState.COMPLETE,
        "FAILED": TrialState.FAIL,
    }
    study_id = storage.get_study_id_from_name("optuna-bench")
    t0 = time.perf_counter()

    def attrs(t: dict[str, Any]) -> dict[str, Any]:
        keep = ("final_val_loss", "min_norm_entropy", "final_rank_ratio", "qk_eig_var")
        return {k: t[k] for k in keep if t[k] is not None} | {"qkscope_state": t["state"]}

    def value(t: dict[str, Any]) -> float | None:
        if state_map[t["state"]] != TrialState.COMPLETE:
            return None
        return float(t["value"]) if t["value"] is not None else 1e9

    first = trials[0]  # through the public API, as the format reference
    study.add_trial(
        create_trial(
            state=state_map[first["state"]],
            value=value(first),
            params=first["params"],
            distributions=dists,
            user_attrs=attrs(first),
            intermediate_values=dict(first["val_curve"]),
        )
    )
    engine = create_engine(normalize_url(url))
    now = datetime.now()
    with engine.begin() as c:
        for i in range(1, len(trials), 2000):
            chunk = trials[i : i + 2000]
            c.execute(
                insert(om.TrialModel.__table__),
                [
                    {
                        "number": t["number"],
                        "study_id": study_id,
                        "state": state_map[t["state"]],
                        "datetime_start": now,
                        "datetime_complete": now,
                    }
                    for t in chunk
                ],
            )
        ids = dict(
            c.execute(
                select(om.TrialModel.number, om.TrialModel.trial_id).where(
                    om.TrialModel.study_id == study_id
                )
            ).all()
        )
        for i in range(1, len(trials), 2000):
            chunk = trials[i : i + 2000]
            c.execute(
                insert(om.TrialParamModel.__table__),
                [
                    {
                        "trial_id": ids[t["number"]],
                        "param_name": k,
                        "param_value": dists[k].to_internal_repr(v),
                        "distribution_json": distribution_to_json(dists[k]),
                    }
                    for t in chunk
                    for k, v in t["params"].items()
                ],
            )
            vals = [(t, value(t)) for t in chunk]
            rows = [
                {
                    "trial_id": ids[t["number"]],
                    "objective": 0,
                    "value": v,
                    "value_type": om.TrialValueModel.TrialValueType.FINITE,
                }
                for t, v in vals
                if v is not None
            ]
            if rows:
                c.execute(insert(om.TrialValueModel.__table__), rows)
            c.execute(
                insert(om.TrialUserAttributeModel.__table__),
                [
                    {"trial_id": ids[t["number"]], "key": k, "value_json": json.dumps(v)}
                    for t in chunk
                    for k, v in attrs(t).items()
                ],
            )
            c.execute(
                insert(om.TrialIntermediateValueModel.__table__),
                [
                    {
                        "trial_id": ids[t["number"]],
                        "step": step,
                        "intermediate_value": iv,
                        "intermediate_value_type": (
                            om.TrialIntermediateValueModel.TrialIntermediateValueType.FINITE
                        ),
                    }
                    for t in chunk
                    for step, iv in t["val_curve"]
                ],
            )
    engine.dispose()
    # The bulk-written trials read back exactly like the one added through the public API.
    check = storage.get_all_trials(study_id, deepcopy=False)
    assert len(check) == len(trials), (len(check), len(trials))
    a, b = check[0], check[1]
    assert set(a.params) == set(b.params) and set(a.user_attrs) <= set(b.user_attrs) | {
        "qkscope_state"
    }
    assert b.intermediate_values and (b.value is not None) == (b.state == TrialState.COMPLETE)
    return "optuna-bench", time.perf_counter() - t0


# ---- timing --------------------------------------------------------------------------------


def timed(
    fn: Callable[[], Any], n: int, warmup: int = 3, budget_s: float | None = None
) -> list[float]:
    """Latencies (ms) of `n` calls after `warmup`; with a budget, at least 2 calls."""
    for _ in range(warmup):
        fn()
    out: list[float] = []
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
        if budget_s is not None and len(out) >= 2 and time.perf_counter() - start > budget_s:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1,000 trials, 200,000 rows")
    p.add_argument("--trials", type=int, default=None, help="trials (default 10,000)")
    p.add_argument("--rows", type=int, default=None, help="metric rows (default 10,000,000)")
    p.add_argument("--repeats", type=int, default=None, help="calls per query (default 200)")
    p.add_argument("--optuna-repeats", type=int, default=None, help="calls per Optuna question")
    p.add_argument(
        "--optuna-budget-s",
        type=float,
        default=20.0,
        help="time cap per Optuna question (at least 2 calls; default 20 s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-optuna", action="store_true", help="skip Optuna's side")
    args = p.parse_args(argv)
    args.trials = args.trials or (1000 if args.quick else 10_000)
    args.rows = args.rows or (200_000 if args.quick else 10_000_000)
    args.repeats = args.repeats or (50 if args.quick else 200)
    args.optuna_repeats = args.optuna_repeats or (10 if args.quick else 20)
    problem = pg_available()
    if problem:
        print(f"queries: PostgreSQL unreachable ({problem}); nothing measured")
        return 0
    load0 = load1()
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    rows_per_trial = max(1, args.rows // args.trials)
    evals = math.ceil(rows_per_trial / len(eval_points(50, rng)))
    trials = [synth_trial(i, rng, evals) for i in range(args.trials)]
    with pg_database("qkscope_bench_queries") as url:
        say(f"queries: loading {args.trials:,} trials, {rows_per_trial * args.trials:,} rows ...")
        engine, sessions, study_id, ids, load = load_qkscope(url, trials, rows_per_trial, args.seed)
        optuna_name, optuna_load_s = (None, 0.0)
        if not args.no_optuna:
            say("queries: loading the same trials into Optuna's RDBStorage ...")
            optuna_name, optuna_load_s = load_optuna(url, trials)
        # Timing starts from a heap like a server's: the synthetic data is dropped and what
        # is left is frozen, so a full GC pass over millions of loader objects never lands
        # inside a timed call.
        del trials
        gc.collect()
        gc.freeze()
        try:
            results = run_queries(args, url, engine, sessions, study_id, ids, optuna_name)
        finally:
            engine.dispose()
    print(f"queries: {machine_line()}")
    print(
        f"PostgreSQL, {args.trials:,} trials, {load['rows']:,} metric rows "
        f"({rows_per_trial} per trial); loaded through insert_metrics in {load['metrics_s']:.0f} s "
        f"({load['rows'] / load['metrics_s']:,.0f} rows/s), Optuna bulk load "
        f"{optuna_load_s:.0f} s; {args.repeats} calls per qkscope query, "
        f"{args.optuna_repeats} per Optuna question; latency in ms"
    )
    print(
        table(
            [
                "question",
                "path",
                "calls",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "rows out",
                "p50 / qkscope functions p50",
            ],
            results,
        )
    )
    worst = max((r[4] for r in results if r[1].startswith("qkscope")), default=float("nan"))
    print(
        f"goal: every qkscope query p95 < {GOAL_P95_MS:.0f} ms: "
        f"{'met' if worst < GOAL_P95_MS else 'NOT met'} (worst p95 {worst:.1f} ms)"
    )
    if w := busy_note(load0):
        print(w)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


def run_queries(
    args: argparse.Namespace,
    url: str,
    engine: Any,
    sessions: Any,
    study_id: int,
    ids: list[int],
    optuna_name: str | None,
) -> list[list[Any]]:
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.config import Settings
    from service.read import queries
    from service.store import Study, session_scope

    pick = random.Random(1)
    probe_trials = [ids[pick.randrange(len(ids))] for _ in range(16)]
    it = iter(range(10**9))

    def next_trial() -> int:
        return probe_trials[next(it) % len(probe_trials)]

    questions: dict[str, dict[str, Any]] = {
        "trial list: COMPLETE, min_norm_entropy>=0.1, sort -final_val_loss, 50": {
            "fn": lambda s: queries.list_trials(
                s,
                study_id,
                states=["COMPLETE"],
                filters=[queries.parse_filter("min_norm_entropy>=0.1")],
                sort="-final_val_loss",
                limit=50,
            )[0],
            "http": lambda: (
                f"/v1/studies/{study_id}/trials",
                {
                    "state": "COMPLETE",
                    "where": "min_norm_entropy>=0.1",
                    "sort": "-final_val_loss",
                    "limit": 50,
                },
            ),
        },
        "trial list: params.regularizer.lambda<0.01, sort params.model.qk_init_std, 50": {
            "fn": lambda s: queries.list_trials(
                s,
                study_id,
                filters=[queries.parse_filter("params.regularizer.lambda<0.01")],
                sort="params.model.qk_init_std",
                limit=50,
            )[0],
            "http": lambda: (
                f"/v1/studies/{study_id}/trials",
                {
                    "where": "params.regularizer.lambda<0.01",
                    "sort": "params.model.qk_init_std",
                    "limit": 50,
                },
            ),
        },
        "one trial's series: attn_entropy_norm, layer 1, head 0": {
            "fn": lambda s: queries.metric_series(
                s, next_trial(), names=["attn_entropy_norm"], layer=1, head=0
            ),
            "http": lambda: (
                f"/v1/trials/{next_trial()}/metrics",
                {"name": "attn_entropy_norm", "layer": 1, "head": 0},
            ),
        },
        "one trial's metrics: all rows": {
            "fn": lambda s: queries.metric_series(s, next_trial()),
            "http": lambda: (f"/v1/trials/{next_trial()}/metrics", {}),
        },
        "study summary": {
            "fn": lambda s: [queries.study_summary(s, s.get(Study, study_id))],
            "http": lambda: (f"/v1/studies/{study_id}/summary", {}),
        },
    }
    results: list[list[Any]] = []
    p50_of: dict[str, float] = {}

    def add(q: str, path: str, ms: list[float], rows_out: int) -> None:
        p50 = percentile(ms, 50)
        if path.startswith("qkscope, functions"):
            p50_of[q] = p50
        base = p50_of.get(q)
        results.append(
            [q, path, len(ms), p50, percentile(ms, 95), percentile(ms, 99), rows_out,
             (p50 / base) if base else None]
        )  # fmt: skip

    for q, spec in questions.items():
        say(f"queries: {q}")
        out: list[Any] = [0]

        def call(fn: Callable[[Any], Any] = spec["fn"], out: list[Any] = out) -> None:
            with session_scope(sessions) as s:
                out[0] = len(fn(s))

        add(q, "qkscope, functions (service.read.queries)", timed(call, args.repeats), out[0])
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(database_url=url, home=Path(home))
        with TestClient(create_app(settings, reconcile_loop=False)) as client:
            for q, spec in questions.items():
                holder: list[int] = [0]

                def get(
                    make: Callable[[], tuple[str, dict[str, Any]]] = spec["http"],
                    holder: list[int] = holder,
                ) -> None:
                    path, params = make()
                    r = client.get(path, params=params)
                    r.raise_for_status()
                    body = r.json()
                    holder[0] = (
                        len(body["items"])
                        if isinstance(body, dict) and "items" in body
                        else (len(body) if isinstance(body, list) else 1)
                    )

                add(q, "qkscope, HTTP (TestClient)", timed(get, args.repeats), holder[0])
    if optuna_name is not None:
        optuna_questions(args, url, optuna_name, add)
    order = {q: i for i, q in enumerate(questions)}
    results.sort(key=lambda r: order.get(r[0], 99))
    return results


def optuna_questions(
    args: argparse.Namespace, url: str, name: str, add: Callable[..., None]
) -> None:
    import optuna
    from optuna.trial import TrialState

    from service.store import normalize_url

    raw = optuna.storages.RDBStorage(normalize_url(url))
    sid = raw.get_study_id_from_name(name)
    warm = optuna.load_study(study_name=name, storage=normalize_url(url))
    t0 = time.perf_counter()
    warm.get_trials(deepcopy=False)  # fill its trial cache once (not timed below)
    say(f"queries: Optuna warm cache filled in {time.perf_counter() - t0:.1f} s")
    tids = [t._trial_id for t in raw.get_all_trials(sid, deepcopy=False)]
    pick = random.Random(2)
    probe = [tids[pick.randrange(len(tids))] for _ in range(16)]
    counter = iter(range(10**9))
    n = args.optuna_repeats

    def list_raw() -> int:
        ts = raw.get_all_trials(sid, deepcopy=False, states=(TrialState.COMPLETE,))
        ok = [t for t in ts if t.user_attrs.get("min_norm_entropy", -1) >= 0.1]
        ok.sort(key=lambda t: -t.user_attrs.get("final_val_loss", math.inf))
        return len(ok[:50])

    def list_warm() -> int:
        ts = warm.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        ok = [t for t in ts if t.user_attrs.get("min_norm_entropy", -1) >= 0.1]
        ok.sort(key=lambda t: -t.user_attrs.get("final_val_loss", math.inf))
        return len(ok[:50])

    def params_raw() -> int:
        ts = raw.get_all_trials(sid, deepcopy=False)
        ok = [t for t in ts if t.params.get("regularizer.lambda", 1) < 0.01]
        ok.sort(key=lambda t: t.params["model.qk_init_std"])
        return len(ok[:50])

    def series_raw() -> int:
        return len(raw.get_trial(probe[next(counter) % len(probe)]).intermediate_values)

    def summary_raw() -> int:
        counts = {st: raw.get_n_trials(sid, (st,)) for st in TrialState}
        best = raw.get_best_trial(sid)
        return len(counts) + (best is not None)

    def summary_warm() -> int:
        ts = warm.get_trials(deepcopy=False)
        counts: dict[Any, int] = {}
        for t in ts:
            counts[t.state] = counts.get(t.state, 0) + 1
        best = warm.best_trial
        return len(counts) + (best is not None)

    say("queries: Optuna's side")
    plan = [
        ("trial list: COMPLETE, min_norm_entropy>=0.1, sort -final_val_loss, 50",
         "Optuna RDBStorage.get_all_trials + Python filter/sort", list_raw),
        ("trial list: COMPLETE, min_norm_entropy>=0.1, sort -final_val_loss, 50",
         "Optuna load_study, warm cache + Python filter/sort", list_warm),
        ("trial list: params.regularizer.lambda<0.01, sort params.model.qk_init_std, 50",
         "Optuna RDBStorage.get_all_trials + Python filter/sort", params_raw),
        ("one trial's series: attn_entropy_norm, layer 1, head 0",
         "Optuna get_trial().intermediate_values (val_loss only)", series_raw),
        ("study summary", "Optuna get_n_trials per state + get_best_trial", summary_raw),
        ("study summary", "Optuna load_study, warm cache: counts + best_trial", summary_warm),
    ]  # fmt: skip
    for q, path, fn in plan:
        holder = [0]

        def call(fn: Callable[[], int] = fn, holder: list[int] = holder) -> None:
            holder[0] = fn()

        add(q, path, timed(call, n, warmup=0, budget_s=args.optuna_budget_s), holder[0])


if __name__ == "__main__":
    sys.exit(main())
