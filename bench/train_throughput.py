"""Throughput cost of probing: `run_trial` against a bare training loop, side by side.

Both train the same model (`workers.trial.build_model`) on the same data stream (the task's
`train_batch` driven by a generator seeded like the trial's) with the same optimizer, batch
size, gradient clipping and LR schedule, for the same number of steps. `run_trial` also does
what a trial does: per-step loss checks, validation and the probe metrics every `eval_every`
steps (TrialConfig defaults), reporting to a reporter that records. The bare loop does none of
that and never synchronises with the host inside the loop.

Runs are interleaved in one process (warm-up, then bare / run_trial pairs, order swapped on
every repeat). The headline ratio is the median over pairs of run_trial's training-loop
tokens/s (its own timer, setup excluded) over the bare loop's; "e2e" also counts run_trial's
setup (task, model, optimizer, probe batch); "best ratio" compares the fastest run of each
kind, which is the less disturbed number on a shared machine. Target: ratio >= 0.95. A
wall-clock budget (--budget-s) trims repeats and configs on a slow or busy machine.

    python -m bench.train_throughput            # default: < 3 minutes on 2 CPU cores
    python -m bench.train_throughput --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine import lr_lambda  # the trial's own LR schedule: both loops take its steps
from workers.regularizers import model_penalty
from workers.tasks import build_task
from workers.trial import (
    MetricPoint,
    TrialConfig,
    build_model,
    resolve_device,
    run_trial,
)

TARGET_RATIO = 0.95


class RecordingReporter:
    """Keeps every report, as a real reporter would (never asks to stop)."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, list[MetricPoint]]] = []

    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None:
        self.reports.append((step, metrics))
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(config: TrialConfig, device: torch.device) -> AbstractContextManager[Any]:
    """The same mixed-precision policy as run_trial (bf16 on CUDA under dtype=auto)."""
    if config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def bare_loop(config: TrialConfig) -> float:
    """Train like run_trial minus probes, eval, reporting and host syncs; training tokens/s."""
    device = resolve_device(config)
    task = build_task(config.task, config.seed)
    model = build_model(config, task).to(device)
    o = config.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    data_gen = torch.Generator().manual_seed(config.seed)
    reg = config.regularizer
    use_penalty = reg.kind != "none" and reg.lam != 0.0
    clip = o.grad_clip
    ctx = _autocast(config, device)
    model.train()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(config.steps):
        x, y = task.train_batch(config.batch_size, data_gen)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with ctx:
            _, loss = model(x, y)
            assert loss is not None
            if use_penalty:
                penalty = model_penalty(model.qk_weights(), reg.kind, reg.target_mean)
                loss = loss + reg.lam * penalty.float()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()
    _sync(device)
    elapsed = time.perf_counter() - t0
    return config.steps * config.batch_size * task.seq_len / elapsed


@dataclass
class TrialRun:
    loop_tps: float  # run_trial's own timer: the training loop incl. evals and probes
    call_tps: float  # wall clock around the whole call, setup included
    n_reports: int


def trial_run(config: TrialConfig) -> TrialRun:
    device = resolve_device(config)
    reporter = RecordingReporter()
    _sync(device)
    t0 = time.perf_counter()
    summary = run_trial(config, reporter)
    _sync(device)
    elapsed = time.perf_counter() - t0
    if summary.status != "completed":
        raise RuntimeError(f"benchmark trial ended {summary.status}")
    tokens = summary.steps_done * config.batch_size * config.task.seq_len
    return TrialRun(summary.tokens_per_s, tokens / elapsed, len(reporter.reports))


@dataclass
class Row:
    name: str
    bare: float  # median tokens/s
    loop: float  # median tokens/s, run_trial's training-loop timer
    call: float  # median tokens/s, whole run_trial call
    ratio: float  # median over repeats of loop / bare of the adjacent pair
    call_ratio: float
    best_ratio: float  # best run_trial loop tokens/s over best bare (robust to interference)
    repeats: int
    n_reports: int


def measure(
    name: str, config: TrialConfig, repeats: int, warmup_steps: int, deadline: float | None
) -> Row:
    """Warm up, then up to `repeats` interleaved pairs (ABBA order); medians of the pairs.

    Stops early (after at least one pair) when another pair would pass `deadline`.
    """
    warm = config.model_copy(update={"steps": warmup_steps})
    bare_loop(warm)
    trial_run(warm)
    bare: list[float] = []
    runs: list[TrialRun] = []
    for r in range(repeats):
        t0 = time.perf_counter()
        if r % 2 == 0:
            bare.append(bare_loop(config))
            runs.append(trial_run(config))
        else:
            runs.append(trial_run(config))
            bare.append(bare_loop(config))
        now = time.perf_counter()
        if deadline is not None and now + (now - t0) > deadline:
            break
    med = statistics.median
    return Row(
        name=name,
        bare=med(bare),
        loop=med(r.loop_tps for r in runs),
        call=med(r.call_tps for r in runs),
        ratio=med(r.loop_tps / b for r, b in zip(runs, bare, strict=True)),
        call_ratio=med(r.call_tps / b for r, b in zip(runs, bare, strict=True)),
        best_ratio=max(r.loop_tps for r in runs) / max(bare),
        repeats=len(bare),
        n_reports=runs[0].n_reports,
    )


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 0.0


def estimate_run_s(config: TrialConfig, warmup_steps: int) -> float:
    """Seconds one full-length run should take, from a short bare run (setup excluded)."""
    tps = bare_loop(config.model_copy(update={"steps": warmup_steps}))
    return config.steps * config.batch_size * config.task.seq_len / tps


def configs(args: argparse.Namespace) -> list[tuple[str, TrialConfig]]:
    base: dict[str, Any] = {
        "model": {"n_layers": args.layers, "d_model": args.d_model, "d_ff": 4 * args.d_model},
        "steps": args.steps,
        "device": args.device,
        "seed": 0,
    }
    out = [(f"L{args.layers} d{args.d_model} no-reg", TrialConfig.model_validate(base))]
    if not args.quick:
        reg = {**base, "regularizer": {"kind": "spectral_variance", "lambda": 0.1}}
        out.append(
            (f"L{args.layers} d{args.d_model} spectral_variance", TrialConfig.model_validate(reg))
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 200)")
    p.add_argument("--repeats", type=int, default=None, help="pairs of runs (default 3)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--quick", action="store_true", help="one config, 100 steps, 2 repeats")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: as given)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="wall-clock budget: fewer repeats / configs when a slow (or busy) machine would "
        "overrun it (default 150; 0 = no limit)",
    )
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 100 if args.quick else 200
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warmup_steps = max(1, min(20, args.steps // 5))

    rows: list[Row] = []
    notes: list[str] = []
    load_before = _load()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s > 0 else None
    all_configs = configs(args)
    for name, cfg in all_configs:
        repeats = args.repeats
        if deadline is not None:
            left = deadline - time.perf_counter()
            # warm-up pair + estimate ~ 0.3 of a run; each repeat is two runs (+10% for probes)
            per_run = estimate_run_s(cfg, warmup_steps) * 1.1
            fits = int((left - 0.5 * per_run) // (2 * per_run))
            if fits < 1 and rows:
                notes.append(f"{name}: skipped, over the {args.budget_s:.0f} s budget")
                continue
            repeats = max(1, min(repeats, fits))
        row = measure(name, cfg, repeats, warmup_steps, deadline)
        if row.repeats < args.repeats:
            notes.append(f"{name}: {row.repeats} repeat(s) instead of {args.repeats} (budget)")
        rows.append(row)
    total = time.perf_counter() - t_start

    first = all_configs[0][1]
    device = resolve_device(first)
    print(
        f"train_throughput: device={device} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} cpus={os.cpu_count()} steps={args.steps} "
        f"batch={first.batch_size} seq_len={first.task.seq_len} task={first.task.kind} "
        f"eval_every={first.eval_every} eval_batches={first.eval_batches} "
        f"probe_batch={first.probe_batch_size}"
    )
    header = (
        f"{'config':<32} {'bare tok/s':>11} {'run_trial tok/s':>16} {'ratio':>6} "
        f"{'e2e tok/s':>10} {'e2e ratio':>9} {'best ratio':>10} {'repeats':>7} {'reports':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.name:<32} {r.bare:>11,.0f} {r.loop:>16,.0f} {r.ratio:>6.3f} "
            f"{r.call:>10,.0f} {r.call_ratio:>9.3f} {r.best_ratio:>10.3f} {r.repeats:>7} "
            f"{r.n_reports:>7}"
        )
    for note in notes:
        print(f"note: {note}")
    load_after = _load()
    cpus = os.cpu_count() or 1
    if max(load_before, load_after) > 0.75 * cpus:
        print(
            f"warning: machine busy (1-min load {load_before:.1f} before, {load_after:.1f} after, "
            f"{cpus} CPUs): other processes distort these timings; compare 'best ratio' or "
            "rerun on an idle machine (--threads 1 is far less sensitive on a shared CPU)"
        )
    worst = min(r.ratio for r in rows)
    verdict = "meets" if worst >= TARGET_RATIO else "is BELOW"
    print(
        f"measured ratio (run_trial / bare training tokens/s, median of paired runs): "
        f"{worst:.3f}, which {verdict} the {TARGET_RATIO} target "
        f"(best-of ratio {min(r.best_ratio for r in rows):.3f}); total {total:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
