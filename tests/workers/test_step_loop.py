"""The GPU-first step loop: divergence found on the device keeps its exact step.

The loop reads its non-finite flag only every NAN_CHECK_EVERY steps and at evaluations, so a
divergence between two evaluations must still be recorded at the step where it happened.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.workers.helpers import Recorder, tiny
from workers.config import TrialConfig
from workers.fused import run_trial_group
from workers.tasks import build_task
from workers.trial import NAN_CHECK_EVERY, build_model, run_trial

WILD: dict[str, Any] = {"name": "sgd", "lr": 10.0, "grad_clip": None, "schedule": "constant"}
# Divergence by arithmetic, not by chaos (plain SGD at lr 10 overflows at a step that the
# CPU's kernels can move by one; tests/workers/test_fused.py): a LocAteR-style penalty that
# pulls every eigenvalue towards 1e3 with lambda 1e6 is 1e6 at step 1, ~6e24 at step 2 and
# overflows at step 3 on any machine, alone and fused.
WILD_REG: dict[str, Any] = {"kind": "locater", "lambda": 1e6, "target_mean": 1e3}


def _locater(model: torch.nn.Module, target: float) -> torch.Tensor:
    """The penalty from the explicit W = w_q^T w_k / sqrt(d_h) of every head (METRICS.md 4):
    the mean over the D eigenvalues of W_sym of (lambda_i - t)^2, mean over layers and heads."""
    pens = []
    for block in model.blocks:  # type: ignore[union-attr]
        attn = block.attn
        h, dh = attn.n_heads, attn.d_head
        wq = attn.q_proj.weight.view(h, dh, -1)
        wk = attn.k_proj.weight.view(h, dh, -1)
        for i in range(h):
            w = wq[i].T @ wk[i] / math.sqrt(dh)  # (D, D)
            sym = (w + w.T) / 2
            d = w.shape[0]
            pens.append((sym * sym).sum() / d - 2 * target * torch.trace(w) / d + target**2)
    return torch.stack(pens).mean()


def _first_bad_step(cfg: TrialConfig) -> int:
    """A plain loop that checks the loss on the host every step (SGD, constant lr, no clip,
    the penalty computed here from the explicit W)."""
    task = build_task(cfg.task, cfg.seed)
    model = build_model(cfg, task)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    reg = cfg.regularizer
    for step in range(cfg.steps):
        x, y = task.train_batch(cfg.batch_size, gen)
        _, loss = model(x, y)
        assert loss is not None
        total = loss + reg.lam * _locater(model, reg.target_mean)
        if not (math.isfinite(loss.item()) and math.isfinite(total.item())):
            return step + 1
        opt.zero_grad()
        total.backward()  # type: ignore[no-untyped-call]
        opt.step()
    raise AssertionError("the premise failed: no divergence")


def test_divergence_between_checks_is_recorded_at_its_exact_step() -> None:
    cfg = tiny(optim=WILD, regularizer=WILD_REG, steps=200, eval_every=150)
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


def _cosine_reference(step: int, lr: float, warmup: int, total: int, lr_end: float) -> float:
    """The schedule written out: linear warmup to `lr`, then half a cosine from `lr` to
    `lr_end` over the remaining steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return lr_end + (lr - lr_end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_cosine_floor_is_the_learning_rate_at_the_last_step() -> None:
    """`optim.min_lr` is the learning rate the cosine reaches (Wortsman et al.: 1e-5); without
    it the cosine ends at 0.1 x the peak, as studies defined before the field expect."""
    from workers.member import lr_lambda

    for min_lr, lr_end in ((None, 0.1 * 0.02), (1e-5, 1e-5), (0.5, 0.02)):
        optim = {"lr": 0.02, "warmup_steps": 5, "schedule": "cosine", "min_lr": min_lr}
        config = tiny(steps=40, optim=optim)
        factor = lr_lambda(config)
        for step in (0, 4, 5, 17, 39, 40):
            want = _cosine_reference(step, 0.02, 5, 40, lr_end)
            assert math.isclose(0.02 * factor(step), want, rel_tol=1e-12), (min_lr, step)
    # the floor above the peak is the peak: constant after warmup
    config = tiny(steps=40, optim={"lr": 0.02, "min_lr": 0.5})
    assert lr_lambda(config)(39) == 1.0
