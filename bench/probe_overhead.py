"""What the instability signals of METRICS.md section 9 add to a trial, measured directly.

`bench/archive/engine_m1.py` timed whole trials against a reference commit; on a busy machine its
rounds vary by more than the few per cent it is asked to resolve. This times, in one
single-threaded process and interleaved, the pieces themselves on engine_m1's trial config:
one training step, the whole evaluation probe (`probe_metrics`), and the part of it the
signals add (`attention_logit_max` per layer on the q, k the probe made, `output_log_z` on its
logits), each the minimum over many repetitions (the least disturbed run). The added share of
a trial's time is then (signals x evaluations) / (steps x step + evaluations x probe).

    .venv/bin/python -m bench.probe_overhead [--reps 200] [--eval-every 50]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench._common import machine_line, say, table
from workers import metrics as M
from workers.engine import PlainRunner, new_member
from workers.evaluation import probe_metrics
from workers.trial import TrialConfig


def config(steps: int, eval_every: int = 50) -> dict[str, object]:
    """The trial the archived bench/archive/engine_m1.py timed (a small locater study)."""
    return {
        "task": {"kind": "associative_recall", "seq_len": 24, "n_symbols": 16, "n_pairs": 6},
        "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
        "regularizer": {"kind": "locater", "lambda": 0.01},
        "optim": {"lr": 0.003, "warmup_steps": 10},
        "batch_size": 32,
        "steps": steps,
        "eval_every": eval_every,
        "eval_batches": 2,
        "device": "cpu",
        "dtype": "float32",
    }


def best(fn: Callable[[], object], reps: int) -> float:
    """The smallest wall time of `reps` calls, in seconds."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--quick", action="store_true", help="20 repetitions")
    args = p.parse_args(argv)
    if args.quick:
        args.reps = 20
    torch.set_num_threads(1)
    say(machine_line())
    cfg = TrialConfig.model_validate(config(args.steps, args.eval_every))
    mem = new_member(cfg, None, torch.device("cpu"))
    runner = PlainRunner(torch.autocast("cpu", enabled=False))
    runner.place([mem])
    healthy = torch.ones(1, dtype=torch.bool)

    def step() -> None:
        runner.train_step([mem.task.train_batch(cfg.batch_size, mem.data_gen)], healthy)

    model, x = mem.model, mem.probe_x
    with torch.no_grad():
        out = model.eval().probe(x)
    model.train()

    def signals() -> None:
        with torch.no_grad():
            for q, k in out.qk:
                M.attention_logit_max(q, k, causal=cfg.model.causal, scale=out.scale)
            M.output_log_z(out.logits)

    t_step = best(step, args.reps)
    t_probe = best(lambda: probe_metrics(model, x), args.reps)
    t_sig = best(signals, args.reps)
    evals = args.steps // args.eval_every
    trial = args.steps * t_step + evals * t_probe
    share = evals * t_sig / (trial - evals * t_sig)
    rows = [
        ["one training step", f"{1e3 * t_step:.3f}"],
        ["the evaluation probe (probe_metrics, signals included)", f"{1e3 * t_probe:.3f}"],
        ["the signals alone (logit max per layer, log Z)", f"{1e3 * t_sig:.3f}"],
    ]
    print(table(["piece (min of reps)", "ms"], rows))
    print(
        f"{args.steps} steps, an evaluation every {args.eval_every}: the signals add "
        f"{100 * share:.2f} % to the trial's compute (step + probe; the validation loss and "
        f"the host work come on top, so the true share is smaller)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
