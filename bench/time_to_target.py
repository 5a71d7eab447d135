"""Time to a stable setting: how long qkscope, plain Optuna and Ray Tune take to find a
setting that is both stable (the constraints hold) and good (validation loss at or below a
target fixed beforehand), side by side in one run, interleaved, over several seeds.

The study: quickstart's model and task (associative recall, 2 layers, d_model 32, 300
steps, an evaluation every 50), three knobs (learning rate, QK init scale, LocAteR-style
lambda), constraints `min_norm_entropy >= 0.1` and `final_rank_ratio >= 0.05` (no entropy
collapse, no rank collapse). `--workload llama` races on issue 34's Llama-style block
(RMSNorm, rotary, SwiGLU) on wikitext-2 instead: learning rate up to 10 (divergence),
weight decay and z-loss, feasible when `min_norm_entropy_ever >= 0.1` and
`max_attn_logit_ever <= 50`; plain Optuna gets the successive-halving pruner there. Two
targets per workload, both from one 96-trial random study of this space
(`--calibrate`) and fixed before any comparison: `common`, the 10th percentile of its feasible
final validation losses, and `hard`, the 5th.

- qkscope with its defaults (TPE, `fuse: auto`, infeasible trials stopped, no loss pruner),
  POSTed to a running `qkscope serve` (its own Ray head, 2 CPUs; a warm standby runner
  waiting, as on any idle service), `parallelism: 2`, cancelled at the budget;
  `qkscope-median` and `qkscope-sh` are the same with the median or the successive halving
  pruner (the infeasible stop still on), `qkscope-fuseN` with an explicit `fuse: N` (no
  ramp; `qkscope-sh-fuseN` both), `qkscope-fixed` with `refill: false` (fixed groups), `qkscope-cold` on a second
  service with `QKSCOPE_STANDBY=0` (each study's job started at its POST) (`--only` picks
  the lines); before every run of every line the benchmark waits until the standby is warm
  again, so no run shares the cores with a standby's start;
- plain Optuna: `n_jobs=2` threads, TPE with the same constraints through
  `Trial.set_constraint`, the median pruner;
- Ray Tune: `OptunaSearch` (TPE; Tune cannot pass constraint values to it) with the ASHA
  scheduler, 2 concurrent trials on a local Ray cluster of 2 CPUs.

Each run has the same wall budget; seeds are interleaved (every line runs seed s before any
runs seed s + 1, in an order that rotates with the seed). Reported per line: the time to the
first trial's end, per target the median time to the first feasible trial at or below it
(inf: not within the budget) with its interquartile range and how many runs reached it, the
best feasible value at the budget, trials finished per hour, and the share of trial compute
spent on trials that did not end feasible and complete; then, per target, each qkscope line
against each peer: the ratio of medians with a 95 % bootstrap interval over seeds.

    .venv/bin/python -m bench.time_to_target [--workload quickstart|llama] [--seeds 20] [--first-seed 0]
        [--budget 45] [--only qkscope,qkscope-sh,qkscope-fixed,optuna,tune] [--json F] [--quick]
    .venv/bin/python -m bench.time_to_target --calibrate [--workload llama] [--trials 96]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench._common import busy_note, load1, machine_line, say, standby_ready, table
from bench.orchestration import post_and_wait, start_serve, stop_serve

CONCURRENCY = 2
DATA_DIR = Path(os.environ.get("QKSCOPE_DATA_DIR") or Path(__file__).parents[2] / "shared/data")


@dataclass(frozen=True)
class Workload:
    """One study to race on: its base config, knobs (all log-uniform floats), constraints
    (what "stable" means), the two targets fixed beforehand, and plain Optuna's pruner."""

    name: str
    steps: int
    space: dict[str, dict[str, Any]]
    constraints: tuple[tuple[str, str, float], ...]  # (summary metric, ">=" or "<=", bound)
    targets: dict[str, float]
    optuna_pruner: str  # "median" or "successive_halving"

    config: dict[str, Any]  # the trial config, less `steps`

    def base(self, steps: int, data_dir: str | None = None) -> dict[str, Any]:
        """The trial config at `steps`; an lm task reads `data_dir` when given (relative to
        QKSCOPE_DATA_DIR for the service), else its absolute path (for the peers)."""
        out = copy.deepcopy(self.config) | {"steps": steps}
        if data_dir is not None and "data_dir" in out["task"]:
            out["task"]["data_dir"] = data_dir
        return out

    def feasible(self, summary: Any) -> bool:
        return all(v <= 0 for v in self.violations(summary))

    def violations(self, summary: Any) -> list[float]:
        """Optuna's constraint values (feasible where <= 0); a missing metric violates."""
        out = []
        for metric, op, bound in self.constraints:
            v = getattr(summary, metric, None)
            if v is None or not math.isfinite(v):
                out.append(1e9)
            else:
                out.append(bound - v if op == ">=" else v - bound)
        return out


WORKLOADS = {
    "quickstart": Workload(
        "quickstart",
        steps=300,
        space={
            "optim.lr": {"type": "float", "low": 3e-4, "high": 3e-2, "log": True},
            "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
            "regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        },
        constraints=(("min_norm_entropy", ">=", 0.1), ("final_rank_ratio", ">=", 0.05)),
        # `hard`: the 5th percentile of the feasible final_val_loss of `--calibrate` (96
        # random trials, seed 0, infeasible trials not stopped; 72 feasible), 2026-11-25
        # 18:18 UTC. `common`: the 10th percentile of the same sweep rerun 2026-11-26 18:31
        # UTC (73 of 96 feasible; its 5th percentile came out 2.47497 again), fixed before
        # the 20-seed comparison: a target most runs reach, so the time to it measures the
        # search more than one lucky draw. See bench/README.md.
        targets={"common": 2.504, "hard": 2.475},
        optuna_pruner="median",
        config={
            "task": {
                "kind": "associative_recall",
                "seq_len": 24,
                "n_symbols": 16,
                "n_pairs": 6,
                "n_valid": 128,
            },
            "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64, "norm": "pre"},
            "regularizer": {"kind": "locater", "target_mean": 0.0},
            "optim": {"lr": 0.003, "warmup_steps": 10},
            "batch_size": 32,
            "eval_every": 50,
            "eval_batches": 2,
            "device": "cpu",
            "dtype": "float32",
        },  # fmt: skip
    ),
    "llama": Workload(
        "llama",
        steps=100,
        space={
            "optim.lr": {"type": "float", "low": 1e-3, "high": 10.0, "log": True},
            "optim.weight_decay": {"type": "float", "low": 1e-5, "high": 0.1, "log": True},
            "z_loss_coef": {"type": "float", "low": 1e-6, "high": 0.1, "log": True},
        },
        constraints=(("min_norm_entropy_ever", ">=", 0.1), ("max_attn_logit_ever", "<=", 50.0)),
        # 10th and 5th percentiles of `--workload llama --calibrate` (96 random trials, seed
        # 0, infeasible trials not stopped: 32 feasible), 2026-11-26 19:40 UTC, fixed before
        # the comparison ran
        targets={"common": 3.4696, "hard": 3.4474},
        optuna_pruner="successive_halving",
        config={  # docs/instability.md's Llama-style block on wikitext-2
            "task": {
                "kind": "lm",
                "data_dir": str(DATA_DIR / "wikitext-2"),
                "train_split": "valid",
                "valid_split": "test",
                "tokenizer": "word",
                "vocab_cap": 500,
                "seq_len": 32,
            },
            "model": {
                "n_layers": 2,
                "n_heads": 2,
                "d_model": 64,
                "d_ff": 172,
                "norm": "pre",
                "norm_type": "rmsnorm",
                "position": "rotary",
                "mlp_type": "swiglu",
            },
            "regularizer": {"kind": "none", "lambda": 0.0, "target_mean": 0.0},
            "optim": {
                "name": "adamw",
                "lr": 0.001,
                "warmup_steps": 10,
                "schedule": "cosine",
                "weight_decay": 1e-4,
                "weight_decay_mode": "independent",
                "grad_clip": 1.0,
            },
            "batch_size": 8,
            "eval_every": 20,
            "eval_batches": 2,
            "device": "cpu",
            "dtype": "float32",
        },  # fmt: skip
    ),
}


@dataclass
class End:
    """One finished trial: when (seconds from the run's start), value, feasible, compute."""

    at: float
    value: float | None
    feasible: bool
    compute_s: float


# ---- qkscope ------------------------------------------------------------------------------


def run_qkscope(
    c: httpx.Client,
    wl: Workload,
    seed: int,
    budget: float,
    steps: int,
    trials: int,
    pruner: str | None = None,
    fuse: int | None = None,
    refill: bool = True,
) -> list[End]:
    body: dict[str, Any] = {
        "name": f"ttt-{wl.name}-{seed}",
        "base": wl.base(steps, data_dir="wikitext-2"),  # relative to QKSCOPE_DATA_DIR
        "search_space": wl.space,
        "sampler": {"kind": "tpe", "seed": seed, "n_startup_trials": 4},
        "budget": {"n_trials": trials, "timeout_s": budget},
        "parallelism": CONCURRENCY,
        "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
        "constraints": [{"metric": k, "op": op, "value": v} for k, op, v in wl.constraints],
        "resources": {"cpus": 1, "gpus": 0},
    }
    if pruner is not None:
        body["pruner"] = {"kind": pruner, "n_startup_trials": 2}
    if fuse is not None:
        body["fuse"] = fuse
    if not refill:
        body["refill"] = False
    t0 = time.time()
    _, _, items = post_and_wait(c, body, poll_s=0.2, cancel_at=t0 + budget)
    ends = []
    for t in items:
        if t["finished_at"] is None or t["state"] not in ("COMPLETE", "PRUNED", "DIVERGED"):
            continue
        full = c.get(f"/v1/trials/{t['id']}").json()["summary"] or {}
        at = datetime.fromisoformat(t["finished_at"]).timestamp() - t0
        ok = t["state"] == "COMPLETE" and bool(t["feasible"])
        ends.append(End(at, t["value"], ok, float(full.get("wall_time_s") or 0.0)))
    return ends


# ---- plain Optuna -------------------------------------------------------------------------


def _config(wl: Workload, steps: int, params: dict[str, Any]) -> Any:
    from service.spec import apply_params
    from workers.config import TrialConfig

    return apply_params(TrialConfig.model_validate(wl.base(steps)), params)


def _suggest(wl: Workload, trial: Any) -> dict[str, float]:
    return {k: trial.suggest_float(k, v["low"], v["high"], log=True) for k, v in wl.space.items()}


def run_optuna(wl: Workload, seed: int, budget: float, steps: int, trials: int) -> list[End]:
    """TPE with the constraints through `Trial.set_constraint` (Optuna 5) and the workload's
    pruner, `n_jobs` threads in one process."""
    import optuna
    import torch

    from workers.trial import run_trial

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ends: list[End] = []
    lock = threading.Lock()
    t0 = time.time()

    def objective(trial: Any) -> float:
        cfg = _config(wl, steps, _suggest(wl, trial))

        class Reporter:
            def report(self, step: int, metrics: list[Any], value: float | None) -> str | None:
                if step == 0:
                    return None
                trial.report(next(m.value for m in metrics if m.name == "val_loss"), step)
                return "optuna pruner" if trial.should_prune() else None

        s = run_trial(cfg, Reporter())
        ok = s.status == "completed" and wl.feasible(s)
        for (metric, _, _), v in zip(wl.constraints, wl.violations(s), strict=True):
            trial.set_constraint(metric, v)
        with lock:
            ends.append(End(time.time() - t0, s.final_val_loss, ok, s.wall_time_s))
        if s.status == "pruned":
            raise optuna.TrialPruned()
        loss = s.final_val_loss
        return float(loss) if loss is not None and math.isfinite(loss) else 1e9

    pruner: optuna.pruners.BasePruner = (
        optuna.pruners.MedianPruner(n_startup_trials=2)
        if wl.optuna_pruner == "median"
        else optuna.pruners.SuccessiveHalvingPruner(min_resource=wl.base(steps)["eval_every"])
    )
    study = optuna.create_study(
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=4), pruner=pruner
    )
    study.optimize(objective, n_trials=trials, n_jobs=CONCURRENCY, timeout=budget)
    return ends


# ---- Ray Tune -----------------------------------------------------------------------------


def _tune_trainable(config: dict[str, Any]) -> None:
    import torch
    from ray import tune

    from workers.trial import run_trial

    torch.set_num_threads(1)
    wl = WORKLOADS[config.get("__workload", "quickstart")]
    cfg = _config(wl, config["__steps"], {k: config[k] for k in wl.space})

    class Reporter:
        def report(self, step: int, metrics: list[Any], value: float | None) -> str | None:
            if step > 0:
                val = next(m.value for m in metrics if m.name == "val_loss")
                tune.report({"final_val_loss": val, "step": step, "done_at": time.time()})
            return None

    s = run_trial(cfg, Reporter())
    loss = s.final_val_loss
    tune.report(
        {
            "final_val_loss": loss if loss is not None and math.isfinite(loss) else 1e9,
            "step": s.steps_done + 1,  # after the last evaluation: the trial's result
            "done_at": time.time(),
            "feasible": wl.feasible(s) and s.status == "completed",
            "wall_time_s": s.wall_time_s,
        }
    )


def run_tune(
    wl: Workload, seed: int, budget: float, steps: int, trials: int, work: Path
) -> list[End]:
    import optuna
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    ray.init(address="local", num_cpus=CONCURRENCY, include_dashboard=False,
             log_to_driver=False, configure_logging=False)  # fmt: skip
    try:
        space = {
            k: optuna.distributions.FloatDistribution(v["low"], v["high"], log=True)
            for k, v in wl.space.items()
        }
        searcher = OptunaSearch(
            space=space,
            metric="final_val_loss",
            mode="min",
            sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=4),
        )
        asha = ASHAScheduler(
            time_attr="step", max_t=steps + 1, grace_period=wl.base(steps)["eval_every"]
        )
        tuner = tune.Tuner(
            tune.with_resources(_tune_trainable, {"cpu": 1}),
            param_space={"__steps": steps, "__workload": wl.name},
            tune_config=tune.TuneConfig(
                search_alg=searcher,
                scheduler=asha,
                metric="final_val_loss",
                mode="min",
                num_samples=trials,
                max_concurrent_trials=CONCURRENCY,
                time_budget_s=budget,
            ),
            run_config=tune.RunConfig(name="ttt", storage_path=str(work), verbose=0),
        )
        t0 = time.time()
        with contextlib.redirect_stdout(sys.stderr):
            grid = tuner.fit()
        ends = []
        for res in grid:
            m = res.metrics or {}
            if "done_at" not in m:
                continue
            done = m.get("feasible") is not None  # reported its result, not stopped by ASHA
            ends.append(
                End(
                    float(m["done_at"]) - t0,
                    float(m["final_val_loss"]) if done else None,
                    bool(m.get("feasible")),
                    float(m.get("wall_time_s", 0.0)),
                )
            )
        return ends
    finally:
        ray.shutdown()


# ---- the figures -------------------------------------------------------------------------


def time_to_target(ends: list[End], budget: float, target: float) -> float:
    """Seconds to the first feasible trial at or below `target` (inf: none within budget)."""
    hits = [
        e.at
        for e in ends
        if e.feasible and e.value is not None and e.value <= target and e.at <= budget
    ]
    return min(hits) if hits else math.inf


def best_at(ends: list[End], budget: float) -> float | None:
    vals = [e.value for e in ends if e.feasible and e.value is not None and e.at <= budget]
    return min(vals) if vals else None


def not_feasible_share(ends: list[End]) -> float:
    total = sum(e.compute_s for e in ends)
    return sum(e.compute_s for e in ends if not e.feasible) / total if total else 0.0


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(25th, 50th, 75th) percentile, inf (a run that never reached the target) sorting last;
    linear interpolation between order statistics, as numpy's default."""
    v = sorted(xs)

    def q(p: float) -> float:
        pos = p * (len(v) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        if lo == hi or v[lo] == v[hi]:
            return v[lo]
        if math.isinf(v[hi]):
            return math.inf
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)

    return q(0.25), q(0.5), q(0.75)


def summarize(name: str, runs: list[list[End]], budget: float, wl: Workload) -> list[Any]:
    bests = [b for r in runs if (b := best_at(r, budget)) is not None]
    per_hour = [3600 * len([e for e in r if e.at <= budget]) / budget for r in runs]
    first = [min((e.at for e in r), default=math.inf) for r in runs]
    row: list[Any] = [name, statistics.median(first)]
    for target in wl.targets.values():
        times = [time_to_target(r, budget, target) for r in runs]
        lo, mid, hi = quartiles(times)
        row += [mid, f"{lo:.1f}-{hi:.1f}", f"{sum(math.isfinite(t) for t in times)}/{len(runs)}"]
    return row + [
        statistics.median(bests) if bests else None,
        statistics.median(per_hour),
        f"{100 * statistics.median(not_feasible_share(r) for r in runs):.0f} %",
    ]


def ratio_interval(
    ours: list[float], peer: list[float], draws: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """A 95 % bootstrap interval of median(peer) / median(ours), seeds resampled with
    replacement within each framework (inf where a framework never reached the target:
    such a median is inf, and a ratio of two infs counts as 1)."""
    import random

    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        a = statistics.median(rng.choices(ours, k=len(ours)))
        b = statistics.median(rng.choices(peer, k=len(peer)))
        ratios.append(1.0 if math.isinf(a) and math.isinf(b) else b / a)
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def ratio_line(ours: str, peer: str, a: list[float], b: list[float]) -> str:
    ma, mb = statistics.median(a), statistics.median(b)
    ratio = 1.0 if math.isinf(ma) and math.isinf(mb) else mb / ma
    lo, hi = ratio_interval(a, b)
    return f"{ours} vs {peer}: {ratio:.2f}x faster to target (95 % bootstrap {lo:.2f}-{hi:.2f}x)"


def serve_env() -> dict[str, str]:
    return {"QKSCOPE_DATA_DIR": str(DATA_DIR)}


def calibrate(wl: Workload, trials: int, steps: int) -> int:
    """The targets: the 5th and 10th percentiles of feasible final losses of a random study."""
    with tempfile.TemporaryDirectory(prefix="qkscope-ttt-cal-") as tmp:
        head, proc, api, _ = start_serve(Path(tmp), CONCURRENCY, serve_env())
        try:
            with httpx.Client(base_url=api, timeout=60) as c:
                body = {
                    "name": f"ttt-calibrate-{wl.name}",
                    "base": wl.base(steps, data_dir="wikitext-2"),
                    "search_space": wl.space,
                    "sampler": {"kind": "random", "seed": 0},
                    "pruner": {"kind": "none", "stop_infeasible": False},
                    "budget": {"n_trials": trials},
                    "parallelism": CONCURRENCY,
                    "constraints": [
                        {"metric": k, "op": op, "value": v} for k, op, v in wl.constraints
                    ],
                }
                _, wall, items = post_and_wait(c, body, poll_s=0.5)
        finally:
            stop_serve(head, proc)
    vals = sorted(t["value"] for t in items if t["feasible"] and t["value"] is not None)
    qs = {p: vals[max(0, math.ceil(p / 100 * len(vals)) - 1)] if vals else None for p in (5, 10)}
    print(f"{trials} random trials ({wall:.0f} s), {len(vals)} feasible; percentiles {qs}")
    print("states:", {s: sum(t["state"] == s for t in items) for s in {t["state"] for t in items}})
    print("feasible values:", " ".join(f"{v:.4f}" for v in vals))
    return 0


def settle(serves: dict[str, Any]) -> None:
    """Before every run of every line: wait until the standby service shows a warm standby
    (the reconciler starts one once the last qkscope study ended), so that no run shares the
    cores with a standby's start, and every qkscope run POSTs to a warm, idle service."""
    if (serve := serves.get("warm")) is not None and serve[1] is not None:
        with httpx.Client(base_url=serve[2], timeout=60) as c:
            standby_ready(c)
    time.sleep(1.0)


def pick(
    name: str, wl: Workload, seed: int, args: argparse.Namespace, serves: dict[str, Any], tmp: Path
) -> list[End]:
    """One run of one line of the comparison."""
    if name.startswith("qkscope"):
        base = name.split("-fuse")[0]  # qkscope-sh-fuse1: the sh line at fuse 1
        pruner = {"qkscope-median": "median", "qkscope-sh": "successive_halving"}.get(base)
        fuse = int(name.split("-fuse")[1]) if "-fuse" in name else None
        serve = serves["cold" if name.endswith("-cold") else "warm"]
        with httpx.Client(base_url=serve[2], timeout=60) as c:
            return run_qkscope(
                c, wl, seed, args.budget, args.steps, args.trials, pruner, fuse,
                refill=name != "qkscope-fixed",
            )  # fmt: skip
    if name == "optuna":
        return run_optuna(wl, seed, args.budget, args.steps, args.trials)
    return run_tune(wl, seed, args.budget, args.steps, args.trials, tmp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="quickstart")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed.. (more runs)")
    p.add_argument("--budget", type=float, default=45.0, help="wall seconds per run")
    p.add_argument("--trials", type=int, default=1000, help="at most this many per run")
    p.add_argument("--steps", type=int, help="steps per trial (the workload's by default)")
    p.add_argument("--only", default="qkscope,optuna,tune")
    p.add_argument("--json", type=Path, help="write every run's trial ends here")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--quick", action="store_true", help="2 seeds, 40 s budgets, 1/3 the steps")
    p.add_argument(
        "--api",
        help="POST the qkscope lines to this running service (its data dir must hold "
        "wikitext-2) instead of starting one; no standby is awaited (tests' smoke runs)",
    )
    args = p.parse_args(argv)
    wl = WORKLOADS[args.workload]
    args.steps = args.steps or wl.steps
    if args.calibrate:
        return calibrate(wl, 96 if args.trials == 1000 else args.trials, args.steps)
    if args.quick:
        args.seeds, args.budget, args.steps = 2, 40.0, max(20, wl.steps // 3)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    say(machine_line())
    load0 = load1()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    runs: dict[str, list[list[End]]] = {n: [] for n in names}
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    with tempfile.TemporaryDirectory(prefix="qkscope-ttt-") as tmp:
        serves: dict[str, Any] = {}
        try:
            # one running service per kind of start, up for the whole comparison
            if args.api:
                serves["warm"] = serves["cold"] = (None, None, args.api)
            elif any(n.startswith("qkscope") and not n.endswith("-cold") for n in names):
                (Path(tmp) / "warm").mkdir()
                serves["warm"] = start_serve(Path(tmp) / "warm", CONCURRENCY, serve_env())
            if not args.api and any(n.startswith("qkscope") and n.endswith("-cold") for n in names):
                (Path(tmp) / "cold").mkdir()
                env = serve_env() | {"QKSCOPE_STANDBY": "0"}
                serves["cold"] = start_serve(Path(tmp) / "cold", CONCURRENCY, env)
            for i, seed in enumerate(seeds):
                # interleaved, each seed runs every line; the order rotates with the seed so
                # no line always runs first (on a cold cache) or right after Ray Tune
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    settle(serves)
                    r = pick(name, wl, seed, args, serves, Path(tmp))
                    runs[name].append(r)
                    hits = ", ".join(
                        f"{k} {time_to_target(r, args.budget, t):.1f} s"
                        for k, t in wl.targets.items()
                    )
                    say(f"  seed {seed} {name}: {len(r)} trials, to target {hits}")
        finally:
            for serve in serves.values():
                if serve[1] is not None:  # started here (not --api)
                    stop_serve(serve[0], serve[1])
    if args.json:
        args.json.write_text(
            json.dumps({"workload": wl.name, "seeds": seeds, "budget": args.budget,
                        "targets": wl.targets,
                        "runs": {n: [[vars(e) for e in r] for r in rs] for n, rs in runs.items()}})
        )  # fmt: skip
    print(f"time_to_target: {machine_line()}")
    targets = ", ".join(f"{k} {v}" for k, v in wl.targets.items())
    print(
        f"workload {wl.name}; targets (feasible final_val_loss at or below): {targets}; seeds "
        f"{seeds[0]}-{seeds[-1]}, {args.budget:.0f} s per run, concurrency {CONCURRENCY}, "
        f"{args.steps} steps per trial"
    )
    header = ["framework", "first trial ended s (median)"]
    for k in wl.targets:
        header += [f"to {k} s (median)", f"{k} IQR", f"{k} reached"]
    header += ["best feasible at budget", "trials/hour", "compute on trials not ending feasible"]
    print(table(header, [summarize(n, runs[n], args.budget, wl) for n in names]))
    peers = [n for n in names if not n.startswith("qkscope")]
    for k, target in wl.targets.items():
        hit = {n: [time_to_target(r, args.budget, target) for r in runs[n]] for n in names}
        print(f"target {k} ({target}):")
        for q in (n for n in names if n.startswith("qkscope")):
            for peer in sorted(peers, key=lambda n: statistics.median(hit[n])):
                print("  " + ratio_line(q, peer, hit[q], hit[peer]))
    if note := busy_note(load0):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
