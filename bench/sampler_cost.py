"""Sampler cost as a study grows: one ask+tell through qkscope's runner path vs Optuna direct.

For each sampler qkscope offers (`service.runner.search.make_sampler`: random, tpe, cmaes, gp,
nsga2, grid) and each storage, a study is grown to 100, 1,000 and 10,000 completed trials
(bulk-written into Optuna's own tables through Optuna's ORM models; the in-memory study
through `add_trials`), and at each size the time of one trial's Optuna work is measured:

- qkscope: a real `service.runner.StudyRunner` (its RDBStorage, its `make_sampler`, on a
  real study row; the spec of study_defs/quickstart.yaml: 2 log-float parameters, 2
  constraints) doing what it does per trial: `study.ask()`, `_suggest` (the spec's search
  space), and at the end `storage.get_trial` (the already-told check), one `set_constraint`
  per constraint, `set_user_attr("qkscope_status")`, `study.tell(values)`.
- Optuna direct: `optuna.load_study` on the same storage with the same sampler; ask,
  `suggest_float` x 2, `set_constraint` x 2, tell. And the same on InMemoryStorage.

The first ask of a freshly loaded study (its trial cache is cold: every trial is read once)
is reported separately from the steady state (median of `--cycles` cycles).
GP is capped at `--gp-max` trials (default 100): an exact Gaussian process costs O(n^3)
per ask; at 1,000 trials one ask already takes 15-60 s on 2 cores (`--gp-max 1000`), so
10,000 would take hours. Prefilled trials carry params, values and
constraint values but not sampler bookkeeping (CMA-ES generations, NSGA-II generations,
grid ids), so those samplers treat the history as foreign trials: they still read all of
it on each ask, which is the cost that grows.

    python -m bench.sampler_cost              # ~5 minutes
    python -m bench.sampler_cost --quick      # 100 and 1,000 trials, fewer cycles
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench._common import busy_note, load1, machine_line, pg_available, pg_database, say, table

SAMPLERS = ["random", "tpe", "cmaes", "gp", "nsga2", "grid"]
LAMBDA_GRID = [1e-4 * (1e4 ** (i / 199)) for i in range(200)]
STD_GRID = [0.02 * (75 ** (i / 99)) for i in range(100)]


def spec_for(kind: str) -> dict[str, Any]:
    space: dict[str, Any] = {
        "regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
    }
    if kind == "grid":
        space["regularizer.lambda"]["grid"] = LAMBDA_GRID
        space["model.qk_init_std"]["grid"] = STD_GRID
    return {
        "name": f"bench-sampler-{kind}",
        "base": {
            "task": {"kind": "associative_recall", "seq_len": 24, "n_symbols": 16, "n_pairs": 6},
            "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
            "regularizer": {"kind": "locater"},
            "steps": 400,
            "eval_every": 50,
        },
        "search_space": space,
        "sampler": {"kind": kind, "seed": 42, "n_startup_trials": 4},
        "budget": {"n_trials": 10_000},
        "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
        "constraints": [
            {"metric": "min_norm_entropy", "op": ">=", "value": 0.1},
            {"metric": "final_rank_ratio", "op": ">=", "value": 0.05},
        ],
    }


CONSTRAINT_KEYS = ["0:min_norm_entropy>=", "1:final_rank_ratio>="]


def fake_history(kind: str, start: int, n: int, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        if kind == "grid":
            params = {"regularizer.lambda": rng.choice(LAMBDA_GRID),
                      "model.qk_init_std": rng.choice(STD_GRID)}  # fmt: skip
        else:
            params = {
                "regularizer.lambda": math.exp(rng.uniform(math.log(1e-4), 0.0)),
                "model.qk_init_std": math.exp(rng.uniform(math.log(0.02), math.log(1.5))),
            }
        out.append(
            {
                "number": start + i,
                "params": params,
                "value": rng.uniform(0.5, 3.0),
                "constraints": [rng.uniform(-0.5, 0.5), rng.uniform(-0.5, 0.5)],
            }
        )
    return out


def distributions(kind: str) -> dict[str, Any]:
    from optuna.distributions import FloatDistribution

    return {
        "regularizer.lambda": FloatDistribution(1e-4, 1.0, log=True),
        "model.qk_init_std": FloatDistribution(0.02, 1.5, log=True),
    }


def bulk_add(url: str, study_name: str, kind: str, history: list[dict[str, Any]]) -> None:
    """COMPLETE trials straight into Optuna's tables, through Optuna's own ORM models."""
    import optuna
    from optuna.distributions import distribution_to_json
    from optuna.storages._rdb import models as om
    from optuna.trial import TrialState
    from sqlalchemy import create_engine, insert, select

    from service.store import normalize_url

    storage = optuna.storages.RDBStorage(normalize_url(url))
    study_id = storage.get_study_id_from_name(study_name)
    dists = distributions(kind)
    now = datetime.now()
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as c:
            for i in range(0, len(history), 2000):
                chunk = history[i : i + 2000]
                c.execute(
                    insert(om.TrialModel.__table__),
                    [
                        {"number": h["number"], "study_id": study_id,
                         "state": TrialState.COMPLETE, "datetime_start": now,
                         "datetime_complete": now}
                        for h in chunk
                    ],
                )  # fmt: skip
                numbers = [h["number"] for h in chunk]
                ids = dict(
                    c.execute(
                        select(om.TrialModel.number, om.TrialModel.trial_id).where(
                            om.TrialModel.study_id == study_id,
                            om.TrialModel.number.in_(numbers),
                        )
                    ).all()
                )
                c.execute(
                    insert(om.TrialParamModel.__table__),
                    [
                        {"trial_id": ids[h["number"]], "param_name": k,
                         "param_value": dists[k].to_internal_repr(v),
                         "distribution_json": distribution_to_json(dists[k])}
                        for h in chunk
                        for k, v in h["params"].items()
                    ],
                )  # fmt: skip
                c.execute(
                    insert(om.TrialValueModel.__table__),
                    [
                        {"trial_id": ids[h["number"]], "objective": 0, "value": h["value"],
                         "value_type": om.TrialValueModel.TrialValueType.FINITE}
                        for h in chunk
                    ],
                )  # fmt: skip
                c.execute(
                    insert(om.TrialSystemAttributeModel.__table__),
                    [
                        {"trial_id": ids[h["number"]], "key": f"constraints:{key}",
                         "value_json": json.dumps(v)}
                        for h in chunk
                        for key, v in zip(CONSTRAINT_KEYS, h["constraints"], strict=True)
                    ],
                )  # fmt: skip
    finally:
        engine.dispose()


def memory_add(study: Any, kind: str, history: list[dict[str, Any]]) -> None:
    from optuna.trial import TrialState, create_trial

    dists = distributions(kind)
    study.add_trials(
        [
            create_trial(
                state=TrialState.COMPLETE,
                value=h["value"],
                params=h["params"],
                distributions=dists,
                system_attrs={
                    f"constraints:{k}": v
                    for k, v in zip(CONSTRAINT_KEYS, h["constraints"], strict=True)
                },
            )
            for h in history
        ]
    )


# ---- one trial's Optuna work -------------------------------------------------------------


def qkscope_cycle(runner: Any, rng: random.Random) -> None:
    from service.runner.configs import suggest

    trial = runner.search.study.ask()
    suggest(runner.spec, trial)
    runner.storage.get_trial(trial._trial_id)
    for key in CONSTRAINT_KEYS:
        trial.set_constraint(key, rng.uniform(-0.5, 0.5))
    trial.set_user_attr("qkscope_status", "completed")
    runner.search.study.tell(trial, [rng.uniform(0.5, 3.0)])


def direct_cycle(study: Any, rng: random.Random) -> None:
    trial = study.ask()
    trial.suggest_float("regularizer.lambda", 1e-4, 1.0, log=True)
    trial.suggest_float("model.qk_init_std", 0.02, 1.5, log=True)
    for key in CONSTRAINT_KEYS:
        trial.set_constraint(key, rng.uniform(-0.5, 0.5))
    study.tell(trial, rng.uniform(0.5, 3.0))


def measure(cycle: Callable[[], None], cycles: int, budget_s: float) -> tuple[float, float, int]:
    """(first call ms, median steady-state ms, cycles run)."""
    t0 = time.perf_counter()
    cycle()
    first = (time.perf_counter() - t0) * 1000
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(cycles):
        t0 = time.perf_counter()
        cycle()
        times.append((time.perf_counter() - t0) * 1000)
        if time.perf_counter() - start > budget_s and len(times) >= 2:
            break
    return first, statistics.median(times), len(times)


# ---- per storage -------------------------------------------------------------------------


def run_rdb(url: str, label: str, args: argparse.Namespace, out: list[dict[str, Any]]) -> None:
    import optuna

    from service.config import Settings
    from service.runner.loop import StudyRunner
    from service.runner.search import make_sampler
    from service.spec import StudySpec
    from service.store import StudyRows, make_engine, make_sessionmaker, upgrade_schema

    upgrade_schema(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as home:
        settings = Settings(database_url=url, home=Path(home))
        for kind in args.samplers:
            spec = StudySpec.model_validate(spec_for(kind))
            row, _ = StudyRows(sessions).create(spec)
            runner = StudyRunner(row.id, settings, engine)  # creates the Optuna study
            name = runner.search.study.study_name
            have = 0
            for size in args.sizes:
                if kind == "gp" and size > args.gp_max:
                    out.append({"sampler": kind, "storage": label, "path": "qkscope runner",
                                "size": size, "skipped": f"gp capped at {args.gp_max}"})  # fmt: skip
                    continue
                n_now = len(
                    runner.storage.get_all_trials(runner.search.study._study_id, deepcopy=False)
                )
                bulk_add(url, name, kind, fake_history(kind, n_now, size - have, rng))
                have = size
                say(f"  {label} {kind} @ {size}")
                runner = StudyRunner(row.id, settings, engine)  # a fresh runner: cold cache
                first, med, n = measure(
                    lambda runner=runner: qkscope_cycle(runner, rng), args.cycles, args.cell_s
                )
                out.append({"sampler": kind, "storage": label, "path": "qkscope runner",
                            "size": size, "first": first, "ms": med, "n": n})  # fmt: skip
                study = optuna.load_study(
                    study_name=name, storage=runner.storage, sampler=make_sampler(spec)
                )
                first, med, n = measure(
                    lambda study=study: direct_cycle(study, rng), args.cycles, args.cell_s
                )
                out.append({"sampler": kind, "storage": label, "path": "Optuna direct",
                            "size": size, "first": first, "ms": med, "n": n})  # fmt: skip
                runner.storage.remove_session()
    engine.dispose()


def run_memory(args: argparse.Namespace, out: list[dict[str, Any]]) -> None:
    import optuna

    from service.runner.search import make_sampler
    from service.spec import StudySpec

    rng = random.Random(0)
    for kind in args.samplers:
        spec = StudySpec.model_validate(spec_for(kind))
        study = optuna.create_study(sampler=make_sampler(spec))
        for size in args.sizes:
            if kind == "gp" and size > args.gp_max:
                out.append({"sampler": kind, "storage": "memory", "path": "Optuna direct",
                            "size": size, "skipped": f"gp capped at {args.gp_max}"})  # fmt: skip
                continue
            memory_add(
                study, kind, fake_history(kind, len(study.trials), size - len(study.trials), rng)
            )
            say(f"  memory {kind} @ {size}")
            first, med, n = measure(
                lambda study=study: direct_cycle(study, rng), args.cycles, args.cell_s
            )
            out.append({"sampler": kind, "storage": "memory", "path": "Optuna direct",
                        "size": size, "first": first, "ms": med, "n": n})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import optuna

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="sizes 100,1000; 4 cycles")
    p.add_argument("--sizes", default=None, help="comma-separated (default 100,1000,10000)")
    p.add_argument("--samplers", default=",".join(SAMPLERS))
    p.add_argument("--storages", default="memory,sqlite,postgresql")
    p.add_argument("--cycles", type=int, default=None, help="timed cycles per cell (10)")
    p.add_argument("--cell-s", type=float, default=5.0, help="time cap per cell (s)")
    p.add_argument(
        "--gp-max", type=int, default=100, help="largest study GP is asked on (default 100)"
    )
    args = p.parse_args(argv)
    args.sizes = [
        int(x) for x in (args.sizes or ("100,1000" if args.quick else "100,1000,10000")).split(",")
    ]
    args.samplers = [s for s in args.samplers.split(",") if s]
    args.cycles = args.cycles or (4 if args.quick else 10)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    load0 = load1()
    t_start = time.perf_counter()
    out: list[dict[str, Any]] = []
    notes: list[str] = []
    for storage in args.storages.split(","):
        say(f"sampler_cost: {storage}")
        if storage == "memory":
            run_memory(args, out)
        elif storage == "sqlite":
            with tempfile.TemporaryDirectory() as d:
                run_rdb(f"sqlite:///{d}/bench.db", "sqlite", args, out)
        elif storage == "postgresql":
            if problem := pg_available():
                notes.append(f"PostgreSQL skipped: {problem}")
                continue
            with pg_database("qkscope_bench_sampler") as url:
                run_rdb(url, "postgresql", args, out)
    print(f"sampler_cost: {machine_line()}")
    print(
        "one trial's Optuna work (ask, suggest x2, 2 constraints, tell), median ms of up to "
        f"{args.cycles} cycles after a warm-up ask; 'first' = first ask+tell of a freshly "
        "loaded study at the largest size (cold trial cache)"
    )
    header = ["sampler", "storage", "path"] + [f"{s:,} trials ms" for s in args.sizes]
    header += [f"x ({args.sizes[-1]:,} / {args.sizes[0]:,})", "first ms (largest)"]
    rows = []
    keys: list[tuple[str, str, str]] = []
    for r in out:
        k = (r["sampler"], r["storage"], r["path"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        cells = {r["size"]: r for r in out if (r["sampler"], r["storage"], r["path"]) == k}
        ms = [cells.get(s, {}).get("ms") for s in args.sizes]
        done = [m for m in ms if m is not None]
        growth = done[-1] / done[0] if len(done) >= 2 and ms[-1] is not None else None
        largest = max(
            (s for s in args.sizes if cells.get(s, {}).get("ms") is not None), default=None
        )
        first = cells[largest]["first"] if largest is not None else None
        rows.append([*k, *ms, growth, first])
    print(table(header, rows))
    skipped = sorted(
        {f"{r['sampler']} @ {r['size']:,}: {r['skipped']}" for r in out if "skipped" in r}
    )
    for s in skipped:
        print(f"skipped: {s} (exact GP is O(n^3) per ask: 15-60 s per ask at 1,000 trials)")
    for n in notes:
        print(f"note: {n}")
    if w := busy_note(load0):
        print(w)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
