"""torch.func as the fused baseline: `stack_module_state` + `vmap(functional_call)` against
qkscope's hand-written fused model, and against the same trials trained one by one.

PyTorch's model-ensembling recipe (and ModelBatch, 7.1x at 8 models) stacks M copies of a
module with `torch.func.stack_module_state` and runs them with
`vmap(functional_call(base, ...))`. qkscope's `workers.fused_model.FusedGPT` writes the
batched matmuls by hand instead. This benchmark trains the same members three ways, in one
run, interleaved, and prints training tokens/s (every member's tokens) at 1, 4, 8, 16 members:

- one by one: each member in its own bare loop, one after another (the sum of their tokens
  over the sum of their times);
- qkscope fused: `workers.fused.FusedRunner.train_step` (forward, penalty, per-member clip,
  per-member AdamW);
- torch.func: the same step with the forward (and the penalty) through
  `vmap(functional_call)` over `stack_module_state`'s stacked weights; the per-member clip
  and AdamW are the same code as qkscope's (`_BatchedOptimizer`: torch.optim cannot step
  stacked weights at a different lr per member), so the two fused arms differ only in the
  model's form.

Both fused arms start from the same weights and see the same batches; the run checks that
their losses agree after the timed steps (a benchmark of two programs that trained different
things would be no comparison).

    python -m bench.func_baseline [--members 1 4 8 16] [--steps 60] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from bench._common import machine_line
from bench.train_throughput import bare_loop
from workers.config import TrialConfig
from workers.engine import new_member
from workers.fused import FusedRunner, _BatchedOptimizer, _clip_per_member, _hyper
from workers.model import GPT
from workers.regularizers import model_penalty

__all__ = ["VmapRunner", "main"]


class _LossWithPenalty(nn.Module):
    """One member's training objective as a module, so `functional_call` swaps its weights in
    the penalty too (the penalty reads the model's query and key weights)."""

    def __init__(self, gpt: GPT, config: TrialConfig) -> None:
        super().__init__()
        self.gpt = gpt
        reg = config.regularizer
        self.kind, self.lam, self.target = reg.kind, reg.lam, reg.target_mean

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        _, loss = self.gpt(x, y)
        assert loss is not None
        if self.kind != "none" and self.lam != 0.0:
            pen = model_penalty(self.gpt.qk_weights(), self.kind, self.target)
            loss = loss + self.lam * pen.float()
        return loss


class VmapRunner:
    """M members as `stack_module_state` weights trained through `vmap(functional_call)`."""

    def __init__(self, models: Sequence[GPT], configs: Sequence[TrialConfig]) -> None:
        wrapped = [_LossWithPenalty(m, c) for m, c in zip(models, configs, strict=True)]
        params, buffers = stack_module_state(wrapped)  # type: ignore[arg-type]
        self.params, self.buffers = params, buffers
        base = _LossWithPenalty(models[0], configs[0])

        def one(p: dict[str, Tensor], b: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
            out = functional_call(base, (p, b), (x, y))
            assert isinstance(out, Tensor)
            return out

        self.loss: Callable[..., Tensor] = vmap(one)
        dev = next(iter(params.values())).device
        self.names = list(params)
        self.opt = _BatchedOptimizer(configs, [params[n] for n in self.names], dev)
        self.clips = torch.tensor(
            [c.optim.grad_clip or float("inf") for c in configs], dtype=torch.float32, device=dev
        )

    def train_step(self, batches: Sequence[tuple[Tensor, Tensor]], factors: Tensor) -> Tensor:
        x = torch.stack([b[0] for b in batches])  # (M, B, T)
        y = torch.stack([b[1] for b in batches])
        loss = self.loss(self.params, self.buffers, x, y)  # (M,)
        for p in self.params.values():
            p.grad = None
        loss.sum().backward()  # type: ignore[no-untyped-call]
        _clip_per_member(self.opt.params, self.clips)
        active = torch.ones(len(batches), dtype=torch.bool, device=x.device)
        self.opt.step(factors, active)
        return loss.detach()


def members(base: TrialConfig, m: int) -> list[TrialConfig]:
    """m trials of one architecture: different seeds and learning rates (as bench.gpu)."""
    return [
        base.model_copy(
            update={"seed": s, "optim": base.optim.model_copy(update={"lr": 1e-3 * (1 + s % 4)})}
        )
        for s in range(m)
    ]


def config(quick: bool, steps: int = 30) -> TrialConfig:
    """bench.gpu's CPU size "2L d64 s32 b16" (associative recall, LocAteR-style penalty)."""
    return TrialConfig.model_validate(
        {
            "task": {"kind": "associative_recall", "n_symbols": 16, "n_pairs": 6, "seq_len": 32},
            "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "d_ff": 256, "norm": "pre"},
            "regularizer": {"kind": "locater", "lambda": 0.01},
            "batch_size": 16,
            "steps": 10 if quick else steps,
            "eval_every": 10,
            "device": "cpu",
        }
    )


def _fused_arms(configs: list[TrialConfig], steps: int) -> tuple[float, float, float]:
    """(fused tok/s, vmap tok/s, largest |loss difference| after `steps` steps)."""
    dev = torch.device("cpu")
    fused_members = [new_member(c, None, dev) for c in configs]
    vmap_members = [new_member(c, None, dev) for c in configs]
    fused = FusedRunner(len(configs), dev, nullcontext())
    fused.place(fused_members)
    func = VmapRunner([m.model for m in vmap_members], configs)
    healthy = torch.ones(len(configs), dtype=torch.bool)
    tokens = steps * sum(c.batch_size * c.task.seq_len for c in configs)
    times: dict[str, float] = {"fused": 0.0, "vmap": 0.0}
    last: dict[str, Tensor] = {}
    for step in range(steps):  # interleaved step by step: both arms see the same load
        factors = _hyper([fused_members[0].lr_factor()] * len(configs), dev)
        for name in ("fused", "vmap") if step % 2 == 0 else ("vmap", "fused"):
            mems = fused_members if name == "fused" else vmap_members
            batches = [m.task.train_batch(m.config.batch_size, m.data_gen) for m in mems]
            t = time.perf_counter()
            if name == "fused":
                last[name] = fused.train_step(batches, healthy).loss
            else:
                last[name] = func.train_step(batches, factors)
            times[name] += time.perf_counter() - t
        for m in fused_members + vmap_members:
            m.step += 1
    diff = float((last["fused"].double() - last["vmap"].double()).abs().max())
    return tokens / times["fused"], tokens / times["vmap"], diff


def one_by_one(configs: list[TrialConfig]) -> float:
    """Every member in its own bare training loop, one after another; aggregate tok/s."""
    tokens = sum(c.steps * c.batch_size * c.task.seq_len for c in configs)
    seconds = sum(c.steps * c.batch_size * c.task.seq_len / bare_loop(c) for c in configs)
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="training steps per arm and repeat")
    p.add_argument("--quick", action="store_true", help="fewer steps and one repeat (smoke)")
    args = p.parse_args(argv)
    base = config(args.quick, args.steps)
    repeats = 1 if args.quick else args.repeats
    print(f"# bench.func_baseline {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"model 2L d64 s32 b16, LocAteR-style penalty, {base.steps} steps, {repeats} repeats")
    _fused_arms(members(base, 2), 3)  # warm-up: first-call costs out of the figures
    print(
        "| members | one by one tok/s | qkscope fused tok/s | torch.func vmap tok/s"
        " | fused / one by one | vmap / one by one | vmap / fused | max loss diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in args.members:
        cfgs = members(base, m)
        runs = []
        for r in range(repeats):  # the arm order alternates: a load change hits both
            if r % 2 == 0:
                runs.append((*_fused_arms(cfgs, base.steps), one_by_one(cfgs)))
            else:
                single_first = one_by_one(cfgs)
                runs.append((*_fused_arms(cfgs, base.steps), single_first))
        fused = statistics.median(r[0] for r in runs)
        vm = statistics.median(r[1] for r in runs)
        diff = max(r[2] for r in runs)
        single = statistics.median(r[3] for r in runs)
        print(
            f"| {m} | {single:,.0f} | {fused:,.0f} | {vm:,.0f} | {fused / single:.2f}"
            f" | {vm / single:.2f} | {vm / fused:.2f} | {diff:.1e} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
