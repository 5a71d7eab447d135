"""Fused model forms: explicit batched matmuls (`FusedGPT`) vs `torch.func.vmap(functional_call)`.

Forward + backward of M stacked GPTs on one batch each, same weights, interleaved repeats;
prints ms per step and the ratio. `workers.fused_model` keeps the faster form (bmm).

    python -m bench.archive.fused_forms [--members 8] [--d-model 32] [--steps 20]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch.func import functional_call, stack_module_state, vmap

from workers.config import ModelConfig
from workers.fused_model import FusedGPT
from workers.model import GPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=24)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=34)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(n_layers=args.layers, n_heads=2, d_model=args.d_model, d_ff=4 * args.d_model)
    models = []
    for s in range(args.members):
        torch.manual_seed(s)
        models.append(GPT(cfg, vocab_size=args.vocab, seq_len=args.seq).to(dev))
    fused = FusedGPT.from_models(models, dev)
    params, buffers = stack_module_state(models)  # type: ignore[arg-type]
    base = copy.deepcopy(models[0])

    def one(
        p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        _, loss = functional_call(base, (p, b), (x, y))
        assert isinstance(loss, torch.Tensor)
        return loss

    batched = vmap(one)
    shape = (args.members, args.batch, args.seq)
    x = torch.randint(0, args.vocab, shape, device=dev)
    y = torch.randint(0, args.vocab, shape, device=dev)

    def step_bmm() -> None:
        fused.forward(x, y).sum().backward()  # type: ignore[no-untyped-call]

    def step_vmap() -> None:
        batched(params, buffers, x, y).sum().backward()  # type: ignore[no-untyped-call]

    def timed(fn: Callable[[], None]) -> float:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return float((time.perf_counter() - t) / args.steps * 1e3)

    rows: dict[str, list[float]] = {"bmm": [], "vmap": []}
    for rep in range(3):
        order = [("bmm", step_bmm), ("vmap", step_vmap)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            rows[name].append(timed(fn))
    bmm, vm = statistics.median(rows["bmm"]), statistics.median(rows["vmap"])
    print(f"device={dev} members={args.members} d_model={args.d_model} layers={args.layers}")
    print("| form | ms / fwd+bwd step |\n|---|---:|")
    print(f"| bmm (FusedGPT) | {bmm:.2f} |\n| vmap(functional_call) | {vm:.2f} |")
    print(f"vmap / bmm time ratio: {vm / bmm:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
