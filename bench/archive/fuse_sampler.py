"""Does fusing trials cost a sampler that learns from results? TPE and GP with 1, 4 and 8
slots per worker, through the REST service, over several seeds, in one run.

One `qkscope serve` (its own Ray head, one CPU for trials: `parallelism: 1`, so a study runs
one worker, of `fuse` slots). The study is the quickstart's (associative recall, 2 layers,
d_model 32; LocAteR-style lambda x QK init scale; constraints `min_norm_entropy >= 0.1`,
`final_rank_ratio >= 0.05`, stopped when infeasible as by default), where fusion pays on a
CPU. Each (sampler, fuse, seed) is a study of `--trials` trials, interleaved by seed so that
the machine's load falls on every configuration alike. Optuna 5's TPE asks with a constant
liar (`constant_liar=True` by default): trials in flight count as bad guesses, so it does
not propose the same point for every free slot. Reported per sampler and slot count, the
median over seeds of:

- the best feasible final validation loss after all the trials (search quality per trial);
- the best feasible loss at equal wall time: within the wall time the fastest slot count
  took for that seed (search quality per second);
- the study's wall time, POST to COMPLETED.

    .venv/bin/python -m bench.archive.fuse_sampler [--seeds 5] [--trials 24] [--steps 300]
        [--samplers tpe,gp] [--fuse 1,4,8] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench._common import busy_note, load1, machine_line, say, table
from bench.orchestration import post_and_wait, start_serve, stop_serve

ROOT = Path(__file__).resolve().parents[1]


def spec(sampler: str, fuse: int, seed: int, trials: int, steps: int) -> dict[str, Any]:
    s = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    s["name"] = f"fuse-{sampler}-{fuse}-s{seed}"
    s["base"].update(steps=steps, eval_every=max(1, steps // 6), device="cpu", dtype="float32")
    s["sampler"] = {"kind": sampler, "seed": seed, "n_startup_trials": 4}
    s["budget"] = {"n_trials": trials}
    s.update(parallelism=1, fuse=fuse, resources={"cpus": 1, "gpus": 0})
    return dict(s)


def _at(t: dict[str, Any], field: str) -> float:
    return datetime.fromisoformat(t[field]).timestamp()


def best_feasible(items: list[dict[str, Any]], by: float | None = None) -> float | None:
    """The lowest value among feasible trials (finished by unix time `by`, if given)."""
    vals = [
        float(t["value"])
        for t in items
        if t["state"] == "COMPLETE"
        and t["feasible"]
        and t["value"] is not None
        and (by is None or _at(t, "finished_at") <= by)
    ]
    return min(vals) if vals else None


def _median(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.median(ys) if ys else None


def run(args: argparse.Namespace) -> list[list[Any]]:
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    fuses = [int(f) for f in args.fuse.split(",")]
    runs: dict[tuple[str, int, int], tuple[float, float, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="qkscope-fuse-sampler-") as tmp:
        head, proc, api, startup = start_serve(Path(tmp), 1)
        say(f"qkscope serve up in {startup:.1f} s")
        try:
            with httpx.Client(base_url=api, timeout=60) as c:
                for seed in range(args.seeds):
                    for sampler in samplers:
                        for fuse in fuses:
                            body = spec(sampler, fuse, seed, args.trials, args.steps)
                            t0 = datetime.now().timestamp()
                            _, wall, items = post_and_wait(c, body, poll_s=0.2)
                            runs[(sampler, fuse, seed)] = (t0, wall, items)
                            say(
                                f"  {sampler} fuse {fuse} seed {seed}: {wall:.1f} s, best "
                                f"feasible {best_feasible(items)}"
                            )
        finally:
            stop_serve(head, proc)
    rows = []
    for sampler in samplers:
        for fuse in fuses:
            after_n, at_t, walls = [], [], []
            for seed in range(args.seeds):
                t0, wall, items = runs[(sampler, fuse, seed)]
                fastest = min(runs[(sampler, f, seed)][1] for f in fuses)
                after_n.append(best_feasible(items))
                at_t.append(best_feasible(items, by=t0 + fastest))
                walls.append(wall)
            rows.append(
                [
                    sampler,
                    fuse,
                    _median(after_n),
                    _median(at_t),
                    statistics.median(walls),
                    sum(x is None for x in at_t),
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--samplers", default="tpe,gp")
    p.add_argument("--fuse", default="1,4,8")
    p.add_argument("--quick", action="store_true", help="2 seeds, 6 trials of 60 steps, tpe")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.trials, args.steps, args.samplers = 2, 6, 60, "tpe"
    say(machine_line())
    load0 = load1()
    rows = run(args)
    print(f"fuse_sampler: {machine_line()}")
    print(
        f"quickstart study, {args.trials} trials x {args.steps} steps, parallelism 1, "
        f"{args.seeds} seeds (medians over seeds)"
    )
    print(
        table(
            [
                "sampler",
                "slots (fuse)",
                "best feasible after all trials",
                "best feasible at equal wall time",
                "wall s",
                "seeds with none feasible in time",
            ],
            rows,
        )
    )
    if note := busy_note(load0):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
