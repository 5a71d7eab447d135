"""How many evaluations in a row a reversible constraint violation must hold before a trial
is stopped (`pruner.infeasible_patience`), chosen from measurements.

Trials of the quickstart study's search space (random, seeded), trained to the end with no
stopping; at every evaluation each quickstart constraint's value is recorded
(`min_norm_entropy >= 0.1`, `final_rank_ratio >= 0.05`: both the last evaluation's value,
so a violation may be undone later). The stopping rule is then replayed on those curves for
each patience: a *false stop* is a trial the rule would have stopped although it ended
feasible (compute saved on a trial that would have counted); *saved* is the share of the
trials' steps the rule would not have trained. The default is the smallest patience with no
false stop in the sample; the sample size says how much that proves.

    .venv/bin/python -m bench.archive.infeasible_patience [--trials 48] [--steps 400] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from bench._common import machine_line, say, table

ROOT = Path(__file__).resolve().parents[1]
BOUNDS = {"min_norm_entropy": 0.1, "final_rank_ratio": 0.05}  # quickstart's, both ">="


def _params(rng: random.Random) -> dict[str, float]:
    """A point of the quickstart search space (log-uniform, as its spec says)."""
    return {
        "regularizer.lambda": math.exp(rng.uniform(math.log(1e-4), math.log(1.0))),
        "model.qk_init_std": math.exp(rng.uniform(math.log(0.02), math.log(1.5))),
    }


def _curves(job: tuple[dict[str, Any], dict[str, float]]) -> dict[str, Any]:
    """Train one trial to the end; each constraint's value at every evaluation."""
    import torch

    torch.set_num_threads(1)
    from service.spec import apply_params
    from workers.config import MetricPoint, TrialConfig
    from workers.trial import run_trial

    base, params = job
    cfg = apply_params(TrialConfig.model_validate(base), params)
    seen: list[tuple[int, list[MetricPoint]]] = []

    class Keep:
        def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None:
            if step > 0:
                seen.append((step, list(metrics)))
            return None

    run_trial(cfg, Keep())
    out: dict[str, Any] = {"steps": [s for s, _ in seen], "params": params}
    out["min_norm_entropy"] = [
        min(p.value for p in pts if p.name == "attn_entropy_norm") for _, pts in seen
    ]
    out["final_rank_ratio"] = [
        max((p for p in pts if p.name == "rank_ratio"), key=lambda p: p.layer or 0).value
        for _, pts in seen
    ]
    return out


def replay(curve: dict[str, Any], patience: int) -> int | None:
    """The step the rule stops the trial at (None: never), as workers/stopping.py does."""
    held = dict.fromkeys(BOUNDS, 0)
    for i, step in enumerate(curve["steps"]):
        for name, bound in BOUNDS.items():
            held[name] = held[name] + 1 if curve[name][i] < bound else 0
            if held[name] >= patience:
                return int(step)
    return None


def feasible(curve: dict[str, Any]) -> bool:
    return all(curve[name][-1] >= bound for name, bound in BOUNDS.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=48)
    p.add_argument("--steps", type=int, default=None, help="default: quickstart's (400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="6 trials of 100 steps")
    args = p.parse_args(argv)
    spec = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    base: dict[str, Any] = {**spec["base"], "device": "cpu", "dtype": "float32"}
    trials = 6 if args.quick else args.trials
    if args.quick or args.steps:
        base["steps"] = 100 if args.quick else args.steps
        base["eval_every"] = min(base["eval_every"], max(1, base["steps"] // 8))
    rng = random.Random(args.seed)
    jobs = [(base, _params(rng)) for _ in range(trials)]
    say(machine_line())
    say(f"{trials} quickstart-space trials x {base['steps']} steps, no stopping ...")
    with ProcessPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        curves = list(pool.map(_curves, jobs))
    ends_feasible = sum(feasible(c) for c in curves)
    total = sum(c["steps"][-1] for c in curves)
    rows = []
    for patience in range(1, len(curves[0]["steps"]) + 1):
        stops = [(c, replay(c, patience)) for c in curves]
        stopped = [(c, s) for c, s in stops if s is not None]
        false = [c for c, _ in stopped if feasible(c)]
        saved = sum(c["steps"][-1] - s for c, s in stopped)
        rows.append(
            [
                str(patience),
                f"{len(stopped)}/{len(curves)}",
                str(len(false)),
                f"{100 * saved / total:.0f} %",
            ]
        )
    print(
        f"{trials} trials of the quickstart space ({base['steps']} steps, evaluations every "
        f"{base['eval_every']}), {ends_feasible} end feasible; constraints "
        + ", ".join(f"{k} >= {v}" for k, v in BOUNDS.items())
    )
    print(table(["patience", "stopped", "false stops", "steps saved"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
