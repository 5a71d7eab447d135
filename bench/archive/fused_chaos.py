"""Fused vs alone vs a 1e-7 nudge of the initial weights: is a fused gap chaos or a bug?

    .venv/bin/python -m bench.archive.fused_chaos --qk 0.22 --steps 160 [--float64]

A fused group of four quickstart trials (seeds 0-3, locater lambda 1e-3, 1e-2, 0.1, 1; the
given qk_init_std) is trained by `run_trial_group`; each member is also run alone by
`run_trial`, and alone again with every initial weight scaled by (1 + 1e-7 x noise). Printed:
the relative val_loss differences at every evaluation. A fused gap of the size of the nudge's
is chaos (rounding amplified); one far beyond it is a different computation. `--float64`
casts the models to double end to end (build_model and `Tensor.float` patched in this
process only): there a correct fused model matches alone to rounding.
Not part of `python -m bench` (not a speed figure); results in bench/README.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import yaml

import workers.fused
import workers.trial
from workers.config import MetricPoint, TrialConfig
from workers.model import GPT
from workers.tasks import Task

QUICKSTART = Path(__file__).resolve().parents[1] / "study_defs" / "quickstart.yaml"
LAMBDAS = (1e-3, 1e-2, 0.1, 1.0)


class _ValLoss:
    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def report(self, step: int, metrics: list[MetricPoint], value: float | None) -> str | None:
        for point in metrics:
            if point.name == "val_loss":
                self.at[step] = point.value
        return None


def _config(seed: int, lam: float, qk: float, steps: int) -> TrialConfig:
    base: dict[str, Any] = yaml.safe_load(QUICKSTART.read_text())["base"]
    data = {**base, "device": "cpu", "dtype": "float32", "steps": steps, "seed": seed}
    data["eval_every"] = max(1, steps // 4)
    data["model"] = {**data["model"], "qk_init_std": qk}
    data["regularizer"] = {**data["regularizer"], "lambda": lam}
    return TrialConfig.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--qk", type=float, default=0.22)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--nudge", type=float, default=1e-7)
    p.add_argument("--float64", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    build = workers.trial.build_model
    nudge = 0.0

    def build_model(config: TrialConfig, task: Task) -> GPT:
        model = build(config, task)
        if nudge:
            gen = torch.Generator().manual_seed(12345)
            with torch.no_grad():
                for w in model.parameters():
                    w.mul_(1 + nudge * torch.randn(w.shape, generator=gen))
        return model.double() if args.float64 else model

    workers.trial.build_model = build_model  # type: ignore[assignment]
    workers.fused.build_model = build_model  # type: ignore[assignment]
    if args.float64:
        torch.Tensor.float = lambda self, *a, **k: self  # type: ignore[assignment,method-assign]
    configs = [_config(s, lam, args.qk, args.steps) for s, lam in enumerate(LAMBDAS)]
    alone = [_ValLoss() for _ in configs]
    for c, r in zip(configs, alone, strict=True):
        workers.trial.run_trial(c, r)
    fused = [_ValLoss() for _ in configs]
    workers.fused.run_trial_group(configs, fused)
    nudge = args.nudge
    nudged = [_ValLoss() for _ in configs]
    for c, r in zip(configs, nudged, strict=True):
        workers.trial.run_trial(c, r)
    dtype = "float64" if args.float64 else "float32"
    print(f"qk_init_std {args.qk}, {args.steps} steps, {dtype}, nudge {args.nudge:g}")
    print("| lambda | step | alone | fused vs alone | nudged vs alone |\n|---|---|---|---|---|")
    for lam, a, f, n in zip(LAMBDAS, alone, fused, nudged, strict=True):
        for step, v in a.at.items():
            fr, nr = abs(f.at[step] - v) / abs(v), abs(n.at[step] - v) / abs(v)
            print(f"| {lam:g} | {step} | {v:.5f} | {fr:.1e} | {nr:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
