"""Warming a worker process before any trial needs it.

A Ray task's first run in a fresh worker process pays for the process, torch's import and
the first calls into torch's kernels (thread pools, allocator): about two seconds on a small
machine, before a trial's first step. A standby runner (service/runner/standby.py) runs
`warm_worker` in the processes its study's slot workers will use, while it waits: Ray
reuses an idle worker process of the same job for the next task, so the study's first slot
workers start in processes that have already paid.
"""

from __future__ import annotations

import os
import time

__all__ = ["warm_worker"]


def warm_worker(linger_s: float = 0.0) -> int:
    """Import what a slot worker imports and train a tiny model for two steps; returns this
    process's id (distinct ids tell how many processes were warmed). `linger_s` keeps the
    process busy a little longer, so that tasks sent together land in distinct processes."""
    from workers import slot_worker  # noqa: F401  (torch, the engine, the fused model)
    from workers.config import TrialConfig
    from workers.trial import run_trial

    config = TrialConfig.model_validate(
        {
            "task": {"kind": "associative_recall", "seq_len": 8, "n_pairs": 2},
            "model": {"n_layers": 1, "n_heads": 1, "d_model": 8, "d_ff": 8},
            "steps": 2,
            "eval_every": 2,
            "batch_size": 2,
        }
    )
    run_trial(config)
    if linger_s > 0:
        time.sleep(linger_s)
    return os.getpid()
