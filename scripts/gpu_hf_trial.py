"""One Hugging Face Llama trial of `study_defs/hf_llama_gpu.yaml`'s base, shortened, on CUDA:
wall, training tokens/s (from the trial's own step clock) and what the probes said; then the
same trial's config in float32 against bf16 autocast for the first evaluation's metrics.

    QKSCOPE_DATA_DIR=<dir holding wikitext-2/> python scripts/gpu_hf_trial.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import yaml

from workers.config import TrialConfig
from workers.trial import run_trial

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--definition", default="study_defs/hf_llama_gpu.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=0, help="0: the definition's")
    args = p.parse_args()
    spec = yaml.safe_load((ROOT / args.definition).read_text())
    base = spec["base"]
    base.update(steps=args.steps, eval_every=max(1, args.steps // 3), seed=0, device=args.device)
    if args.batch_size:
        base["batch_size"] = args.batch_size
    cuda = args.device == "cuda"
    root = Path(os.environ.get("QKSCOPE_DATA_DIR", ROOT.parent / "shared" / "data"))
    base["task"] = {**base["task"], "data_dir": str(root / base["task"]["data_dir"])}
    base["optim"] = {**base["optim"], "warmup_steps": max(1, args.steps // 10)}
    print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda", flush=True)
    for dtype in ("bfloat16", "float32"):
        cfg = TrialConfig.model_validate({**base, "dtype": dtype})
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        s = run_trial(cfg)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tokens = cfg.batch_size * cfg.task.seq_len * args.steps
        keep = {k: v for k, v in s.model_dump().items() if not isinstance(v, (list, dict))}
        print(
            f"{dtype}: wall {wall:.1f} s, {tokens / wall:,.0f} tokens/s end to end "
            f"(probes, BPE and eval included), peak mem "
            f"{torch.cuda.max_memory_allocated() / 2**30 if cuda else 0:.2f} GiB",
            flush=True,
        )
        print(json.dumps(keep, default=str)[:3000], flush=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
