"""Orchestration overhead: qkscope end to end vs Ray Tune + OptunaSearch vs plain Optuna.

All three run the same trial function (`workers.trial.run_trial` of the same small model,
a few seconds each, checkpointing after every evaluation like a qkscope trial), the same
search space, the same sampler (TPE, seed 42, 4 startup trials), the same trial count
(default 24) and the same concurrency (2), with one torch thread per trial:

- qkscope: `qkscope serve` as a subprocess (temp QKSCOPE_HOME, SQLite, its own Ray head on
  free ports, 2 CPUs); POST /v1/studies, poll GET /v1/studies/{id} every 0.1 s until
  COMPLETED. Wall = POST -> COMPLETED (service startup reported separately). Ray sets
  OMP_NUM_THREADS=1 in each 1-CPU trial task, so torch uses one thread.
- Ray Tune: `Tuner` with `OptunaSearch` (same TPE sampler), `max_concurrent_trials=2`, one
  CPU per trial, on a fresh local Ray cluster (2 CPUs); reports every evaluation with
  `tune.report`. Wall = `Tuner.fit()` (ray.init reported separately).
- plain Optuna: `study.optimize(n_trials, n_jobs=2)` (threads, in-memory storage),
  `torch.set_num_threads(1)`.

Ideal wall = sum of the trials' own compute (`TrialSummary.wall_time_s`, run_trial's own
timer around its training loop, identical in all three) / concurrency; overhead per trial =
(wall - ideal) / trials. qkscope's goals: overhead <= 100 ms per trial, wall <= Ray Tune's.

    python -m bench.orchestration                 # 24 trials each, ~5 minutes on 2 cores
    python -m bench.orchestration --quick         # 6 trials of 100 steps
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench._common import (
    RayHead,
    busy_note,
    free_port,
    load1,
    machine_line,
    say,
    standby_ready,
    table,
)

GOAL_OVERHEAD_S = 0.100
ROOT = Path(__file__).resolve().parents[1]

SEARCH_SPACE: dict[str, dict[str, Any]] = {
    "regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
    "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
}


def base_config(steps: int) -> dict[str, Any]:
    return {
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
        "steps": steps,
        "eval_every": 50,
        "device": "cpu",
    }


def study_spec(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": "bench-orchestration",
        "base": base_config(args.steps),
        "search_space": SEARCH_SPACE,
        "sampler": {"kind": "tpe", "seed": args.seed, "n_startup_trials": 4},
        "pruner": {"kind": "none"},
        "budget": {"n_trials": args.trials},
        "parallelism": args.concurrency,
        "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
        "resources": {"cpus": 1, "gpus": 0},
        "max_retries": 0,
    }


def make_trial_config(args_steps: int, params: dict[str, Any], ckpt_dir: str) -> Any:
    """The TrialConfig qkscope's runner would build: base + params + a checkpoint dir."""
    from service.spec import apply_params
    from workers.trial import TrialConfig

    cfg = apply_params(TrialConfig.model_validate(base_config(args_steps)), params)
    return cfg.model_copy(
        update={"checkpoint": cfg.checkpoint.model_copy(update={"dir": ckpt_dir})}
    )


def tpe_sampler(seed: int) -> Any:
    import optuna

    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4)


def optuna_space() -> dict[str, Any]:
    from optuna.distributions import FloatDistribution

    return {
        k: FloatDistribution(v["low"], v["high"], log=v["log"]) for k, v in SEARCH_SPACE.items()
    }


@dataclass
class Result:
    name: str
    wall_s: float
    trials: int
    compute_s: list[float]  # each trial's own training-loop time (run_trial's timer)
    startup_s: float  # service / cluster startup, not in wall
    extra: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 2
    # What one trial costs run alone (a one-by-one line's median compute in the same run):
    # set for a line that fused its trials, whose members' own clocks overlap (`fused`).
    alone_s: float | None = None

    @property
    def ideal_s(self) -> float:
        """The trials run one by one, `concurrency` at a time, with no overhead."""
        if self.alone_s is not None:
            return self.trials * self.alone_s / self.concurrency
        return sum(self.compute_s) / self.concurrency

    @property
    def fused(self) -> bool:
        """More trials in flight than the concurrency: members shared a worker, and each
        member's compute clock counts the time its mates trained too."""
        return float(self.extra.get("in_flight", 0.0)) > self.concurrency + 0.25

    def overhead_per_trial(self) -> float:
        return (self.wall_s - self.ideal_s) / self.trials


# ---- qkscope -------------------------------------------------------------------------------


def start_serve(work: Path, concurrency: int, extra_env: dict[str, str] | None = None) -> Any:
    """A Ray head of our own (free ports) and `qkscope serve` on it, as a user would run them.

    Returns (head, serve process, API URL, seconds until both were up). The head is started
    by the benchmark rather than by `serve` because LocalRayHead leaves the dashboard
    agent on Ray's fixed default port, which a second head on a shared machine loses.
    """
    home = work / "qkscope-home"
    home.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    head = RayHead(work / "ray", concurrency)
    head.start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QKSCOPE_", "RAY_ADDRESS"))}
    env.update(head.env())
    env.update(
        {
            "QKSCOPE_HOME": str(home),
            "QKSCOPE_RAY_ADDRESS": head.address,
            "QKSCOPE_CHECKPOINT_DIR": str(work / "ckpt-qkscope"),
        }
    )
    env.update(extra_env or {})
    qkscope = shutil.which("qkscope", path=str(Path(sys.executable).parent)) or "qkscope"
    log = open(work / "serve.log", "wb")  # noqa: SIM115 - closed by stop_serve
    proc = subprocess.Popen(
        [qkscope, "serve", "--port", str(port)],
        env=env,
        cwd=work,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    proc.log = log  # type: ignore[attr-defined]
    api = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=api, timeout=30) as c:
        while True:
            if proc.poll() is not None:
                head.stop()
                raise RuntimeError(
                    f"qkscope serve exited: {(work / 'serve.log').read_text()[-2000:]}"
                )
            try:
                if c.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - t0 > 300:
                stop_serve(head, proc)
                raise TimeoutError("qkscope serve not up after 300 s")
            time.sleep(0.2)
    return head, proc, api, time.perf_counter() - t0


def post_and_wait(
    c: httpx.Client,
    spec: dict[str, Any],
    poll_s: float = 0.1,
    cancel_at: float | None = None,
) -> tuple[int, float, list[dict[str, Any]]]:
    """POST a study, wait until it ends; returns (id, seconds from POST to the end, its
    trials' list rows). With `cancel_at` (unix time) the study is cancelled then, and what
    ended before is kept. Raises unless it COMPLETED (or was cancelled so)."""
    t0 = time.perf_counter()
    r = c.post("/v1/studies", json=spec)
    r.raise_for_status()
    sid = int(r.json()["id"])
    cancelled = False
    while (study := c.get(f"/v1/studies/{sid}").json())["status"] not in (
        "COMPLETED",
        "FAILED",
        "CANCELLED",
    ):
        if cancel_at is not None and not cancelled and time.time() > cancel_at:
            c.post(f"/v1/studies/{sid}/cancel").raise_for_status()
            cancelled = True
        time.sleep(poll_s)
    wall = time.perf_counter() - t0
    if study["status"] != "COMPLETED" and not (cancelled and study["status"] == "CANCELLED"):
        raise RuntimeError(f"study {sid} ended {study['status']}: {study.get('error')}")
    items = c.get(f"/v1/studies/{sid}/trials", params={"limit": 1000}).json()["items"]
    return sid, wall, list(items)


def stop_serve(head: Any, proc: Any) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()
    head.stop()


def run_qkscope(args: argparse.Namespace, work: Path) -> Result:
    head, proc, api, startup = start_serve(work, args.concurrency)
    try:
        with httpx.Client(base_url=api, timeout=60) as c:
            startup += standby_ready(c)  # a running service: idle, its standby warm
            say(f"  qkscope serve up and warm in {startup:.1f} s; POST study")
            t_post = time.perf_counter()
            r = c.post("/v1/studies", json=study_spec(args))
            r.raise_for_status()
            sid = r.json()["id"]
            while True:
                study = c.get(f"/v1/studies/{sid}").json()
                if study["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
                    break
                if time.perf_counter() - t_post > args.timeout:
                    raise TimeoutError(f"study not done after {args.timeout} s: {study}")
                time.sleep(0.1)
            wall = time.perf_counter() - t_post
            if study["status"] != "COMPLETED":
                raise RuntimeError(f"study ended {study['status']}: {study.get('error')}")
            page = c.get(f"/v1/studies/{sid}/trials", params={"limit": 1000}).json()
            items = page["items"]
            compute, durations = [], []
            for t in items:
                full = c.get(f"/v1/trials/{t['id']}").json()
                compute.append(float(full["summary"]["wall_time_s"]))
                durations.append(float(t["duration_s"]))
            summary = c.get(f"/v1/studies/{sid}/summary").json()
        from datetime import datetime

        created = datetime.fromisoformat(study["created_at"])
        starts = [datetime.fromisoformat(t["started_at"]).timestamp() for t in items]
        ends = [datetime.fromisoformat(t["finished_at"]).timestamp() for t in items]
        gaps = refill_gaps(starts, ends)
        in_flight = mean_in_flight(starts, ends)
        started = datetime.fromisoformat(study["started_at"])
        return Result(
            "qkscope (REST, Ray job)",
            wall,
            len(items),
            compute,
            startup,
            {
                "duration_s": durations,
                "refill_s": gaps,
                "in_flight": in_flight,
                "runner_init_s": min(starts) - started.timestamp(),
                "job_start_s": (started - created).total_seconds(),
                "best": summary["best_value"],
            },
        )
    except BaseException:
        say((work / "serve.log").read_text()[-3000:])
        raise
    finally:
        stop_serve(head, proc)


def refill_gaps(starts: list[float], ends: list[float]) -> list[float]:
    """How long each freed slot waited for its next trial (seconds, never negative).

    A trial's end frees a slot; the next trial to start takes the oldest slot still free
    (first in, first out). A start with no freed slot waiting filled a slot that was never
    used before (the first trials, and slots a `fuse: auto` ramp opens): no gap. This holds
    for any number of member slots, fused or not; pairing the k-th start with the
    (k - workers)-th end, as this benchmark once did, assumed one trial per worker and gave
    negative gaps under fusion."""
    events = sorted([(t, 0) for t in ends] + [(t, 1) for t in starts])  # an end first on a tie
    free: list[float] = []
    gaps: list[float] = []
    for t, kind in events:
        if kind == 0:
            free.append(t)
        elif free:
            gaps.append(t - free.pop(0))
    return gaps


def mean_in_flight(starts: list[float], ends: list[float]) -> float:
    """The mean number of trials in flight while any was: the sum of their durations over
    the span from the first start to the last end. Per-trial costs divided by it are their
    share of the wall, for one trial per worker (it is then the worker count) and for fused
    slots alike."""
    span = max(ends) - min(starts)
    return sum(e - s for s, e in zip(starts, ends, strict=True)) / span if span > 0 else 1.0


# ---- Ray Tune ------------------------------------------------------------------------------


def _tune_trainable(config: dict[str, Any]) -> None:
    import torch
    from ray import tune

    torch.set_num_threads(1)
    from workers.trial import run_trial

    params = {k: config[k] for k in SEARCH_SPACE}
    ckpt = os.path.join(config["__ckpt_root"], tune.get_context().get_trial_id())
    cfg = make_trial_config(config["__steps"], params, ckpt)

    class Reporter:
        def report(self, step: int, metrics: list[Any], value: float | None) -> str | None:
            val = next(m.value for m in metrics if m.name == "val_loss")
            tune.report({"final_val_loss": val, "step": step})
            return None

    summary = run_trial(cfg, Reporter())
    tune.report(
        {
            "final_val_loss": summary.final_val_loss,
            "step": summary.steps_done,
            "wall_time_s": summary.wall_time_s,
        }
    )


def run_tune(args: argparse.Namespace, work: Path) -> Result:
    import ray
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    t0 = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=args.concurrency,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    startup = time.perf_counter() - t0
    try:
        searcher = OptunaSearch(
            space=optuna_space(),
            metric="final_val_loss",
            mode="min",
            sampler=tpe_sampler(args.seed),
        )
        tuner = tune.Tuner(
            tune.with_resources(_tune_trainable, {"cpu": 1}),
            param_space={"__steps": args.steps, "__ckpt_root": str(work / "ckpt-tune")},
            tune_config=tune.TuneConfig(
                search_alg=searcher,
                num_samples=args.trials,
                max_concurrent_trials=args.concurrency,
            ),
            run_config=tune.RunConfig(name="bench", storage_path=str(work / "tune"), verbose=0),
        )
        t1 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # Tune prints its own progress boxes
            grid = tuner.fit()
        wall = time.perf_counter() - t1
        compute = []
        errors = 0
        for res in grid:
            if res.error is not None:
                errors += 1
                continue
            compute.append(float(res.metrics["wall_time_s"]))
        if errors:
            raise RuntimeError(f"{errors} Ray Tune trials failed")
        best = grid.get_best_result(metric="final_val_loss", mode="min").metrics["final_val_loss"]
        return Result(
            "Ray Tune + OptunaSearch", wall, len(compute), compute, startup, {"best": best}
        )
    finally:
        ray.shutdown()


# ---- plain Optuna --------------------------------------------------------------------------


def run_optuna(args: argparse.Namespace, work: Path) -> Result:
    import optuna
    import torch

    from workers.trial import run_trial

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    compute: list[float] = []

    def objective(trial: optuna.Trial) -> float:
        params = {
            k: trial.suggest_float(k, v["low"], v["high"], log=v["log"])
            for k, v in SEARCH_SPACE.items()
        }
        cfg = make_trial_config(args.steps, params, str(work / "ckpt-optuna" / str(trial.number)))

        class Reporter:
            def report(self, step: int, metrics: list[Any], value: float | None) -> str | None:
                val = next(m.value for m in metrics if m.name == "val_loss")
                trial.report(val, step)
                return "optuna pruner" if trial.should_prune() else None

        summary = run_trial(cfg, Reporter())
        compute.append(summary.wall_time_s)
        return float(summary.final_val_loss if summary.final_val_loss is not None else 1e9)

    study = optuna.create_study(
        sampler=tpe_sampler(args.seed),
        direction="minimize",
        pruner=optuna.pruners.NopPruner(),  # like the other two: no pruning
    )
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=args.trials, n_jobs=args.concurrency)
    wall = time.perf_counter() - t0
    return Result(
        "plain Optuna (n_jobs threads)",
        wall,
        len(compute),
        compute,
        0.0,
        {"best": study.best_value},
    )


# ---- main ----------------------------------------------------------------------------------


def qkscope_breakdown(q: Result) -> str:
    """Where qkscope's (wall - ideal) went: per-study costs vs per-trial costs."""
    conc, n = q.extra["in_flight"], q.trials
    parts = {
        "Ray job start (POST -> runner RUNNING)": q.extra["job_start_s"],
        "runner init (RUNNING -> first trial row: inbox actor, first ask)": q.extra[
            "runner_init_s"
        ],
        "task overhead (duration_s - compute, incl. each worker's first torch import) / "
        f"{conc:.2f} in flight": sum(
            d - c for d, c in zip(q.extra["duration_s"], q.compute_s, strict=False)
        )
        / conc,
        f"slot refill (result recorded -> next start, FIFO) / {conc:.2f} in flight": sum(
            q.extra["refill_s"]
        )
        / conc,
    }
    rest = (
        "fusion (negative: what training members together saved) and the rest (uneven "
        "finish of the last trials, final status, 0.1 s polling)"
        if q.fused
        else "rest (uneven finish of the last trials, final status, 0.1 s polling)"
    )
    parts[rest] = q.wall_s - q.ideal_s - sum(parts.values())
    rows = [[k, v, 1000 * v / n] for k, v in parts.items()]
    med_task = statistics.median(
        d - c for d, c in zip(q.extra["duration_s"], q.compute_s, strict=False)
    )
    med_refill = statistics.median(q.extra["refill_s"]) if q.extra["refill_s"] else 0.0
    marginal = (med_task + med_refill) / conc
    return (
        table(["qkscope: wall - ideal, split", "s", "ms per trial"], rows)
        + f"\nqkscope per-trial (marginal) overhead: median task overhead "
        f"{1000 * med_task:.0f} ms + median slot refill {1000 * med_refill:.0f} ms, over "
        f"{conc:.2f} trials in flight = {1000 * marginal:.0f} ms per trial; the rest is paid "
        "once per study"
    )


RUNNERS = {"qkscope": run_qkscope, "tune": run_tune, "optuna": run_optuna}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="6 trials of 100 steps")
    p.add_argument("--trials", type=int, default=None, help="trials per framework (default 24)")
    p.add_argument("--steps", type=int, default=None, help="training steps per trial (300)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--only", default="qkscope,tune,optuna", help="comma-separated subset")
    p.add_argument("--timeout", type=float, default=400.0, help="per-study limit, seconds")
    args = p.parse_args(argv)
    args.trials = args.trials or (6 if args.quick else 24)
    args.steps = args.steps or (100 if args.quick else 300)
    load0 = load1()
    t_start = time.perf_counter()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="qkscope-bench-orch-") as tmp:
        for name in [n.strip() for n in args.only.split(",") if n.strip()]:
            work = Path(tmp) / name
            work.mkdir()
            say(f"orchestration: {name}, {args.trials} trials x {args.steps} steps ...")
            r = RUNNERS[name](args, work)
            r.concurrency = args.concurrency
            results.append(r)
            say(f"  {name}: wall {r.wall_s:.1f} s, ideal {r.ideal_s:.1f} s")
    print(f"orchestration: {machine_line()}")
    print(
        f"{args.trials} trials x {args.steps} steps (associative recall, 2 layers, d_model 32, "
        f"checkpoint every eval), TPE seed {args.seed}, concurrency {args.concurrency}, "
        "1 torch thread per trial"
    )
    tune = next((r for r in results if r.name.startswith("Ray Tune")), None)
    alone = next((r for r in results if not r.fused and not r.name.startswith("qkscope")), None)
    for r in results:
        if r.fused and alone is not None:  # the same trials, one by one, in this run
            r.alone_s = statistics.median(alone.compute_s)
            say(f"  {r.name}: fused; ideal from {alone.name}'s median trial compute")
    rows = []
    for r in results:
        rows.append(
            [
                r.name,
                r.wall_s,
                r.ideal_s,
                r.overhead_per_trial() * 1000,
                statistics.median(r.compute_s),
                r.wall_s / tune.wall_s if tune else None,
                r.startup_s,
                r.extra.get("best"),
            ]
        )
    print(
        table(
            [
                "framework",
                "wall s",
                "ideal s",
                "overhead ms/trial",
                "median trial compute s",
                "wall / Ray Tune",
                "startup s (not in wall)",
                "best val loss",
            ],
            rows,
        )
    )
    q = next((r for r in results if r.name.startswith("qkscope")), None)
    if q is not None:
        print(qkscope_breakdown(q))
        ok_o = q.overhead_per_trial() <= GOAL_OVERHEAD_S
        verdict = [
            f"overhead <= 100 ms/trial (wall-based, per-study start included): "
            f"{'met' if ok_o else 'NOT met'} ({1000 * q.overhead_per_trial():.0f} ms)"
        ]
        if tune is not None:
            ok_w = q.wall_s <= tune.wall_s
            verdict.append(f"wall <= Ray Tune's: {'met' if ok_w else 'NOT met'}")
        print("goals (qkscope): " + "; ".join(verdict))
    if w := busy_note(load0):
        print(w)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
