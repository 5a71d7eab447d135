"""The trial engine at one slot vs the `run_trial` it replaced, side by side in one run.

`run_trial` is now the trial engine (workers/engine.py) with one slot over a plain GPT. This
runs the same trial with the current code and with the code of a reference commit (checked out
in a temporary git worktree), alternating, each in a fresh single-threaded process, and
prints the training steps/s of each and their ratio (goal: >= 0.97).

    .venv/bin/python -m bench.archive.engine_m1 [--ref d93dac7] [--rounds 5] [--steps 600]
        [--eval-every 50]

`--eval-every 10` evaluates (and probes) five times as often as the default: the worst case
for what the probes cost (issue 34's instability signals are measured there too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._common import busy_note, load1, machine_line, say, table

ROOT = Path(__file__).resolve().parents[1]

# One quickstart-sized trial with the penalty on, timed by the trial's own clock.
CHILD = """
import json, sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from workers.trial import TrialConfig, run_trial
cfg = TrialConfig.model_validate(json.loads(sys.argv[2]))
run_trial(cfg.model_copy(update={"steps": 20}))  # warm-up
c0 = time.process_time()
s = run_trial(cfg)
cpu = time.process_time() - c0
print(json.dumps({"steps_per_s": s.steps_done / s.wall_time_s, "steps_per_cpu_s": s.steps_done / cpu}))
"""


def config(steps: int, eval_every: int = 50) -> dict[str, object]:
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


def one(tree: Path, steps: int, eval_every: int = 50) -> tuple[float, float]:
    """(steps per wall second, steps per CPU second of the process) of one trial."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), json.dumps(config(steps, eval_every))],
        check=True,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["steps_per_s"]), float(got["steps_per_cpu_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="d93dac7", help="the commit with the old run_trial")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rounds, steps = (2, 100) if args.quick else (args.rounds, args.steps)
    say(machine_line())
    load_before = load1()
    with tempfile.TemporaryDirectory(prefix="qkscope-ref-") as tmp:
        ref = Path(tmp) / "ref"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(ref), args.ref],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        try:
            new, old, new_cpu, old_cpu = [], [], [], []
            for r in range(rounds):
                wall, cpu = one(ref, steps, args.eval_every)
                old.append(wall)
                old_cpu.append(cpu)
                wall, cpu = one(ROOT, steps, args.eval_every)
                new.append(wall)
                new_cpu.append(cpu)
                say(
                    f"round {r + 1}: ref {old[-1]:.1f} steps/s ({old_cpu[-1]:.1f} per CPU s), "
                    f"this {new[-1]:.1f} steps/s ({new_cpu[-1]:.1f} per CPU s)"
                )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref)], cwd=ROOT)
    ratio = statistics.median(n / o for n, o in zip(new, old, strict=True))
    cpu_ratio = statistics.median(n / o for n, o in zip(new_cpu, old_cpu, strict=True))
    rows = [
        [
            f"run_trial at {args.ref}",
            f"{statistics.median(old):.1f}",
            "1.00",
            f"{statistics.median(old_cpu):.1f}",
            "1.00",
        ],
        [
            "run_trial, this tree",
            f"{statistics.median(new):.1f}",
            f"{ratio:.3f}",
            f"{statistics.median(new_cpu):.1f}",
            f"{cpu_ratio:.3f}",
        ],
    ]
    # steps per CPU second: what the code costs, much less moved by other processes on a
    # busy machine than steps per wall second (the trial is single-threaded)
    heads = ["code", "steps/s (median)", "ratio", "steps/CPU s (median)", "CPU ratio"]
    print(table(heads, rows))
    if note := busy_note(load_before):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
