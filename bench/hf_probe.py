"""The probe's share of a Hugging Face model's trial (`model.kind: hf`, METRICS.md section 10),
beside the built-in model of the same shape.

Training runs the family's SDPA attention; evaluations switch to qkscope's registered probing
attention function (workers/models/hf.py). This times, in one single-threaded process and
interleaved, one training step and one whole evaluation probe (`probe_metrics`) for a small
Llama (2 layers, hidden 64, 4 query heads over 2 key heads, SwiGLU 176) and for the built-in
model at the same width, depth and heads, each the minimum over many repetitions. The probe's
share of a trial is (evaluations x probe) / (steps x step + evaluations x probe).

    .venv/bin/python -m bench.hf_probe [--reps 50] [--eval-every 50]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench._common import machine_line, say, table
from workers.engine import PlainRunner, new_member
from workers.evaluation import probe_metrics
from workers.trial import TrialConfig

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
BUILTIN = {
    "n_layers": 2,
    "n_heads": 4,
    "d_model": 64,
    "d_ff": 176,
    "norm_type": "rmsnorm",
    "position": "rotary",
    "mlp_type": "swiglu",
}


def config(model: dict[str, Any], steps: int, eval_every: int) -> TrialConfig:
    return TrialConfig.model_validate(
        {
            "task": {"kind": "associative_recall", "seq_len": 64, "n_symbols": 16, "n_pairs": 16},
            "model": model,
            "optim": {"lr": 0.003},
            "batch_size": 16,
            "steps": steps,
            "eval_every": eval_every,
            "probe_batch_size": 8,
            "device": "cpu",
        }
    )


def best(fn: Callable[[], object], reps: int) -> float:
    """The smallest wall time of `reps` calls, in seconds."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def timings(cfg: TrialConfig, reps: int) -> tuple[float, float]:
    """(one training step, one evaluation probe), seconds."""
    mem = new_member(cfg, None, torch.device("cpu"))
    runner = PlainRunner(torch.autocast("cpu", enabled=False))
    runner.place([mem])
    healthy = torch.ones(1, dtype=torch.bool)

    def step() -> None:
        runner.train_step([mem.task.train_batch(cfg.batch_size, mem.data_gen)], healthy)

    def probe() -> None:
        probe_metrics(mem.model, mem.probe_x)

    step(), probe()  # warm up
    t_step = t_probe = float("inf")
    for _ in range(reps // 10 or 1):  # interleaved rounds
        t_step = min(t_step, best(step, 10))
        t_probe = min(t_probe, best(probe, 10))
    return t_step, t_probe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="10 repetitions")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 10
    torch.set_num_threads(1)
    say(machine_line())
    evals = args.steps // args.eval_every
    rows = []
    results = {}
    for label, model in (
        ("hf llama", {"kind": "hf", "hf": {"model_type": "llama", "config": LLAMA}}),
        ("built-in (rotary, RMSNorm, SwiGLU)", BUILTIN),
    ):
        t_step, t_probe = timings(config(model, args.steps, args.eval_every), args.reps)
        share = evals * t_probe / (args.steps * t_step + evals * t_probe)
        results[label] = (t_step, t_probe)
        rows.append(
            [label, f"{1e3 * t_step:.2f}", f"{1e3 * t_probe:.2f}", f"{t_probe / t_step:.2f}",
             f"{100 * share:.1f}%"]
        )  # fmt: skip
    print(
        table(
            [
                "model",
                "step ms",
                "probe ms",
                "probe / step",
                f"probe share (eval_every {args.eval_every})",
            ],
            rows,
        )
    )
    (hs, hp), (bs, bp) = results.values()
    print(f"hf / built-in: step x{hs / bs:.2f}, probe x{hp / bp:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
