"""Filling an accelerator: bare loop vs run_trial vs fused trials, and a study of small trials.

Side by side in one run, with printed ratios (issue 10):

(a) at four model sizes, training tokens/s and MFU of the bare loop
    (bench.train_throughput.bare_loop: no probes, no syncs), of `run_trial`, and of a fused
    group of M copies of the trial (`workers.fused.run_trial_group`, M different seeds/lrs),
    whose tokens/s counts every member's tokens;
(b) a study of N small trials three ways: one at a time in one process ("one trial per
    device"), K worker processes at once with torch threads split between them (as Ray does),
    and fused groups of G: trials/hour, aggregate tokens/s and peak memory.

MFU = (6 N + 12 L D T) x tokens/s / peak, N = every parameter. The peak is 989e12 FLOP/s
(H100 SXM dense bf16) on CUDA; on CPU it is *measured* here (the best float32 matmul rate of
this machine, 1024^3, all threads), so CPU MFU says how close a loop gets to this CPU's own
matmul speed, not to any accelerator.

On CUDA the sizes are the issue's (WikiText-2 word LM, bf16, 150 steps; data from
--data-dir); on CPU they are scaled down (associative recall, float32) so the whole run takes
minutes on two cores. Not measured here: POST-to-first-step latency through the service.

    python -m bench.gpu                 # CUDA if present, else the CPU sizes
    python -m bench.gpu --quick         # fewer steps, smaller study
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench._common import machine_line
from bench.train_throughput import bare_loop, trial_run
from workers.config import TrialConfig
from workers.fused import run_trial_group
from workers.trial import run_trial

H100_BF16_PEAK = 989e12
DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"


def cpu_peak_flops() -> float:
    """Best float32 matmul rate of this CPU (FLOP/s), all torch threads."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = 0.0
    for _ in range(20):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * 1024**3 / (time.perf_counter() - t))
    return best


def n_params(cfg: TrialConfig, vocab: int) -> int:
    m = cfg.model
    per_layer = 4 * m.d_model**2 + (2 * m.d_model * m.d_ff if m.mlp else 0) + 4 * m.d_model
    return m.n_layers * per_layer + vocab * m.d_model + cfg.task.seq_len * m.d_model


def flops_per_token(cfg: TrialConfig, vocab: int) -> float:
    m = cfg.model
    return 6 * n_params(cfg, vocab) + 12 * m.n_layers * m.d_model * cfg.task.seq_len


def sizes(cuda: bool, steps: int, data_dir: Path) -> list[tuple[str, TrialConfig, int, int]]:
    """(name, config, vocab, fused members) per size."""
    if cuda:
        task = {
            "kind": "lm",
            "data_dir": str(data_dir),
            "train_split": "valid",
            "valid_split": "test",
            "vocab_cap": 10000,
        }
        shapes = [  # name, layers, d_model, heads, seq, batch, norm, members
            ("1L d128 s128 b64", 1, 128, 1, 128, 64, "post", 16),
            ("6L d512 s256 b32", 6, 512, 8, 256, 32, "pre", 4),
            ("12L d768 s512 b16", 12, 768, 12, 512, 16, "pre", 2),
            ("12L d768 s512 b64", 12, 768, 12, 512, 64, "pre", 2),
        ]
        vocab_of = 10001
    else:
        task = {"kind": "associative_recall", "n_symbols": 16, "n_pairs": 6}
        shapes = [
            ("1L d32 s24 b32", 1, 32, 1, 24, 32, "post", 8),
            ("2L d64 s32 b16", 2, 64, 2, 32, 16, "pre", 4),
            ("4L d128 s64 b8", 4, 128, 4, 64, 8, "pre", 2),
            ("4L d128 s64 b32", 4, 128, 4, 64, 32, "pre", 2),
        ]
        vocab_of = 34
    out = []
    for name, n_l, d, h, seq, batch, norm, members in shapes:
        cfg = TrialConfig.model_validate(
            {
                "task": {**task, "seq_len": seq},
                "model": {"n_layers": n_l, "d_model": d, "n_heads": h, "d_ff": 4 * d, "norm": norm},
                "regularizer": {"kind": "locater", "lambda": 0.01},
                "batch_size": batch,
                "steps": steps,
                "eval_every": max(1, steps // 3),
                "eval_batches": 4,
            }
        )
        out.append((name, cfg, vocab_of, members))
    return out


def _members(cfg: TrialConfig, m: int) -> list[TrialConfig]:
    return [
        cfg.model_copy(
            update={"seed": s, "optim": cfg.optim.model_copy(update={"lr": 1e-3 * (1 + s % 4)})}
        )
        for s in range(m)
    ]


def fused_tps(cfg: TrialConfig, m: int) -> float:
    """Training tokens/s of a fused group of m members, every member's tokens counted."""
    out = run_trial_group(_members(cfg, m))
    return sum(s.tokens_per_s for s in out)  # each member: its tokens over the group's time


SMOKE = False  # --smoke: one size, a few steps: every code path once, for CI (tests/test_bench.py)


def part_a(cuda: bool, steps: int, peak: float, data_dir: Path) -> list[str]:
    lines = [
        "| size | bare tok/s | run_trial tok/s | fused tok/s (M) | run_trial/bare | fused/run_trial"
        " | MFU bare | MFU run_trial | MFU fused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, cfg, vocab, m in sizes(cuda, steps, data_dir)[: 1 if SMOKE else None]:
        warm = cfg.model_copy(update={"steps": max(5, steps // 10)})
        bare_loop(warm)
        run_trial_group(_members(warm, m))
        bare = statistics.median(bare_loop(cfg) for _ in range(2))
        trial = statistics.median(trial_run(cfg).loop_tps for _ in range(2))
        fused = fused_tps(cfg, m)
        fpt = flops_per_token(cfg, vocab)
        lines.append(
            f"| {name} | {bare:,.0f} | {trial:,.0f} | {fused:,.0f} ({m}) | {trial / bare:.2f}"
            f" | {fused / trial:.2f} | {100 * fpt * bare / peak:.1f} %"
            f" | {100 * fpt * trial / peak:.1f} % | {100 * fpt * fused / peak:.1f} % |"
        )
        print(lines[-1], flush=True)
    return lines


def _peak_mem_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(args: tuple[list[dict[str, Any]], int]) -> tuple[float, float]:
    """Run trials one after another in this process; (tokens, peak memory MB)."""
    configs, threads = args
    torch.set_num_threads(threads)
    tokens = 0.0
    for data in configs:
        s = run_trial(TrialConfig.model_validate(data))
        tokens += s.steps_done * data["batch_size"] * data["task"]["seq_len"]
    return tokens, _peak_mem_mb()


def _fused_worker(args: tuple[list[dict[str, Any]], int, int]) -> tuple[float, float]:
    configs, group, threads = args
    torch.set_num_threads(threads)
    cfgs = [TrialConfig.model_validate(d) for d in configs]
    tokens = 0.0
    for i in range(0, len(cfgs), group):
        for s, c in zip(run_trial_group(cfgs[i : i + group]), cfgs[i : i + group], strict=True):
            tokens += s.steps_done * c.batch_size * c.task.seq_len
    return tokens, _peak_mem_mb()


def part_b(cuda: bool, n_trials: int, steps: int, k: int, group: int, data_dir: Path) -> list[str]:
    _, small, _, _ = sizes(cuda, steps, data_dir)[0]
    configs = [c.model_dump(mode="json", by_alias=True) for c in _members(small, n_trials)]
    threads = torch.get_num_threads()
    ctx = mp.get_context("spawn")
    rows: list[tuple[str, float, float, float]] = []

    def run(name: str, fn: Any, jobs: list[Any]) -> None:
        t = time.perf_counter()
        with ctx.Pool(len(jobs)) as pool:
            results = pool.map(fn, jobs)
        wall = time.perf_counter() - t
        tokens = sum(r[0] for r in results)
        rows.append((name, n_trials / wall * 3600, tokens / wall, sum(r[1] for r in results)))
        print(f"{name}: {wall:.1f} s", flush=True)

    run("one at a time (1 process)", _worker, [(configs, threads)])
    per = max(1, threads // k)
    run(
        f"{k} processes, {per} thread(s) each",
        _worker,
        [(configs[i::k], per) for i in range(k)],
    )
    run(f"fused groups of {group} (1 process)", _fused_worker, [(configs, group, threads)])
    base = rows[0]
    lines = [
        f"study: {n_trials} trials of '{sizes(cuda, steps, data_dir)[0][0]}', {steps} steps each",
        "| how | trials/hour | aggregate tok/s | peak memory (MB, all processes) | vs one at a time |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, tph, tps, mem in rows:
        lines.append(f"| {name} | {tph:,.0f} | {tps:,.0f} | {mem:,.0f} | {tps / base[2]:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="qkscope on an accelerator: bare vs trial vs fused")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="one size, a few steps (CI: not a figure)")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR)
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--skip-a", action="store_true")
    p.add_argument("--skip-b", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    peak = H100_BF16_PEAK if cuda else cpu_peak_flops()
    steps_a = (30 if args.quick else 150) if cuda else (20 if args.quick else 60)
    steps_b = (300 if args.quick else 1500) if cuda else (40 if args.quick else 100)
    if args.smoke:
        global SMOKE
        SMOKE, steps_a, steps_b = True, 10, 5
        args.trials, args.processes, args.group = 2, 2, 2
    k = args.processes if cuda else min(args.processes, os.cpu_count() or 1)
    print(f"# bench.gpu {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(
        f"peak for MFU: {peak:.3g} FLOP/s ({'H100 bf16 dense' if cuda else 'measured CPU fp32 matmul'})"
    )
    out: list[str] = []
    if not cuda and not args.skip_a:  # a busy machine lowers the measured peak: re-measure
        part = part_a(cuda, steps_a, peak, args.data_dir)
        peak2 = max(peak, cpu_peak_flops())
        if peak2 > peak:
            print(f"re-measured peak {peak2:.3g}: MFU columns above used {peak:.3g}")
        out += ["", "(a) bare loop vs run_trial vs fused", *part]
        args.skip_a = True
    if not args.skip_a:
        out += [
            "",
            "(a) bare loop vs run_trial vs fused",
            *part_a(cuda, steps_a, peak, args.data_dir),
        ]
    if not args.skip_b:
        trials = min(args.trials, 8) if args.quick else args.trials
        out += [
            "",
            "(b) a study of small trials",
            *part_b(cuda, trials, steps_b, k, args.group, args.data_dir),
        ]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
