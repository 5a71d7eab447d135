"""The GPU-first step loop: divergence found on the device keeps its exact step.

The loop reads its non-finite flag only every NAN_CHECK_EVERY steps and at evaluations, so a
divergence between two evaluations must still be recorded at the step where it happened.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.workers.test_trial import Recorder, tiny
from workers.config import TrialConfig
from workers.fused import run_trial_group
from workers.tasks import build_task
from workers.trial import NAN_CHECK_EVERY, build_model, run_trial

WILD: dict[str, Any] = {"name": "sgd", "lr": 10.0, "grad_clip": None, "schedule": "constant"}


def _first_bad_step(cfg: TrialConfig) -> int:
    """A plain loop that checks the loss on the host every step (SGD, constant lr, no clip)."""
    task = build_task(cfg.task, cfg.seed)
    model = build_model(cfg, task)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    for step in range(cfg.steps):
        x, y = task.train_batch(cfg.batch_size, gen)
        _, loss = model(x, y)
        assert loss is not None
        if not math.isfinite(float(loss)):
            return step + 1
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    raise AssertionError("the premise failed: no divergence")


def test_divergence_between_checks_is_recorded_at_its_exact_step() -> None:
    cfg = tiny(optim=WILD, steps=200, eval_every=150)
    expected = _first_bad_step(cfg)
    assert 1 < expected < NAN_CHECK_EVERY  # between two host checks
    rec = Recorder()
    alone = run_trial(cfg, rec)
    assert alone.status == "diverged"
    assert alone.diverged_at_step == expected
    assert alone.steps_done == expected - 1
    assert rec.reports == []  # nothing evaluated or reported past the bad step
    (fused,) = run_trial_group([cfg])
    assert fused.status == "diverged"
    assert fused.diverged_at_step == expected
    assert fused.steps_done == expected - 1
