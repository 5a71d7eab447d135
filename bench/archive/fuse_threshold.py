"""Where fusion stops paying on a CPU: 4 members in one fused model vs one plain trial.

A Ray worker of a CPU study gets one CPU and one torch thread, and `parallelism` workers
already fill the cores, so on a CPU fusion can only save per-operation overhead. This times,
in one single-threaded process, the trial engine over the plain runner (one trial, as
`fuse: 1` trains it) and over the fused runner with 4 members (seeds 0-3), for configs from
the study definitions at several step sizes, and prints trials/s fused over plain next to
the step's FLOPs (`workers.fusion_plan.step_flops`). `AUTO_FUSE_MAX_FLOPS` is read off it.

    .venv/bin/python -m bench.archive.fuse_threshold [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from bench._common import busy_note, load1, machine_line, say, table
from service.spec import StudySpec
from workers.config import TrialConfig
from workers.engine import Engine, PlainRunner, autocast_for, new_member, resolve_device
from workers.fused import FusedRunner
from workers.fusion_plan import AUTO_FUSE_MAX_FLOPS, step_flops

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
MEMBERS = 4


def base(name: str) -> TrialConfig:
    raw = yaml.safe_load((ROOT / "study_defs" / f"{name}.yaml").read_text())
    return StudySpec.model_validate(raw).base


def variant(config: TrialConfig, steps: int, **changes: Any) -> TrialConfig:
    """`config` with model fields (n_layers, d_model, d_ff, block) and seq_len changed."""
    model = config.model.model_copy(
        update={k: v for k, v in changes.items() if k in ("n_layers", "d_model", "d_ff", "block")}
    )
    task = config.task.model_copy(update={k: v for k, v in changes.items() if k == "seq_len"})
    if task.data_dir:
        task = task.model_copy(update={"data_dir": str(DATA)})
    return config.model_copy(update={"model": model, "task": task, "steps": steps, "device": "cpu"})


def cases() -> list[tuple[str, TrialConfig]]:
    recall, quick = base("repro_entropy_collapse"), base("quickstart")
    chars = base("repro_rank_collapse_variants")
    return [
        ("recall L2 d32 T10 B32", variant(recall, 300)),
        ("recall L2 d32 T24 B32 (quickstart)", variant(quick, 300)),
        ("char L1 d32 T64 B16", variant(chars, 100, d_model=32, d_ff=128, block="attn_mlp_skip")),
        ("char L1 d64 T32 B16", variant(chars, 100, block="attn_mlp_skip", seq_len=32)),
        ("recall L2 d64 T24 B32", variant(quick, 200, d_model=64, d_ff=128)),
        ("char L1 d64 T64 B16", variant(chars, 100, block="attn_mlp_skip")),
        ("recall L4 d64 T24 B32", variant(quick, 150, n_layers=4, d_model=64, d_ff=128)),
    ]


def train(configs: list[TrialConfig], fused: bool) -> float:
    """Seconds to admit and train `configs` to their end (setup of members included)."""
    device = resolve_device(configs[0])
    ctx = autocast_for(configs[0], device)
    runner = FusedRunner(len(configs), device, ctx) if fused else PlainRunner(ctx)
    engine = Engine(runner, device, ctx)
    t0 = time.perf_counter()
    for i, c in enumerate(configs):
        engine.admit(new_member(c, None, device, tag=i))
    engine.run()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="best of N for each timing")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    before = load1()
    say(machine_line())
    rows = []
    for name, config in cases():
        members = [config.model_copy(update={"seed": s}) for s in range(MEMBERS)]
        plain = min(train([config], fused=False) for _ in range(args.repeats))
        fused = min(train(members, fused=True) for _ in range(args.repeats))
        flops = step_flops(config)
        auto = "fused" if flops < AUTO_FUSE_MAX_FLOPS else "1 slot"
        rows.append([name, f"{flops / 1e9:.3f}", f"{plain:.2f}", f"{fused:.2f}",
                     f"{MEMBERS * plain / fused:.2f}x", auto])  # fmt: skip
    say(table(["config", "GFLOP/step", "plain s/trial", f"fused x{MEMBERS} s",
               "fused trials/s vs plain", "fuse: auto (CPU)"], rows))  # fmt: skip
    note = busy_note(before)
    if note:
        say(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
