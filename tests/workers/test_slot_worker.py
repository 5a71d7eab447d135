"""A slot worker's memory budget: the estimate behind its slot count on a GPU, and an
out-of-memory that hands every member back (each resumes from its own checkpoint, in a
worker with one slot fewer) instead of failing them all."""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray
import torch

from tests.workers.helpers import tiny
from workers.engine import build_model
from workers.fusion_plan import (
    AUTO_FUSE_MAX_FLOPS,
    auto_fuse,
    estimated_params,
    member_bytes,
    slots_that_fit,
    step_flops,
    vocab_bound,
)
from workers.inbox import TrialInboxActor
from workers.messages import Assignment, Failed, HandedBack
from workers.slot_worker import SlotWorker
from workers.tasks import build_task


@pytest.mark.parametrize(
    "model",
    [
        {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
        {"n_layers": 4, "n_heads": 4, "d_model": 64, "d_ff": 256, "qk_norm": "layernorm"},
        {"n_layers": 3, "n_heads": 1, "d_model": 48, "d_ff": 96, "mlp": False, "norm": "none"},
        # issue 34's options: SwiGLU's third matrix, RMSNorm, rotary (no position embedding)
        {
            "n_layers": 2,
            "n_heads": 2,
            "d_model": 64,
            "d_ff": 512,
            "mlp_type": "swiglu",
            "norm_type": "rmsnorm",
            "position": "rotary",
            "sigma_reparam": "all",
        },
    ],
)
def test_the_parameter_estimate_bounds_the_real_model(model: dict[str, Any]) -> None:
    cfg = tiny(model=model)
    task = build_task(cfg.task, cfg.seed)
    real = sum(p.numel() for p in build_model(cfg, task).parameters())
    est = estimated_params(cfg, task.vocab_size)
    assert real <= est <= 1.1 * real + 1000, (real, est)
    # weights, gradients and two AdamW moments at least
    assert member_bytes(cfg, task.vocab_size) >= 16 * real


def test_slots_fit_the_free_memory() -> None:
    cfg = tiny()
    one = member_bytes(cfg, 16)
    assert slots_that_fit(cfg, 16, 10 * one, wanted=64) == 8  # 80 % of ten members' memory
    assert slots_that_fit(cfg, 16, 10 * one, wanted=4) == 4
    assert slots_that_fit(cfg, 16, one // 2, wanted=4) == 1  # never fewer than one
    bigger = tiny(batch_size=64)
    assert member_bytes(bigger, 16) > one  # activations grow with the batch


@pytest.mark.cluster
def test_out_of_memory_hands_every_member_back_with_one_slot_fewer(tmp_path: Any) -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        inbox = TrialInboxActor.remote()  # type: ignore[attr-defined]
        items = [
            Assignment(s, tiny(seed=s, checkpoint={"dir": str(tmp_path / f"t{s}")}))
            for s in range(3)
        ]
        worker = SlotWorker("w", 3, inbox)
        worker.admit(items)
        for _ in range(7):
            worker.engine.iterate()
        worker.on_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
        assert worker.engine is None and worker.capacity == 2
        returned = _drain_ends(inbox, 3)
        assert sorted(r.trial for r in returned) == [0, 1, 2]
        assert all(r == HandedBack("w", r.trial, 2) for r in returned)
        # nothing recorded them as stopped: each resumes from its checkpoint (step 5)
        assert not any((tmp_path / f"t{s}" / "stopped.json").exists() for s in range(3))
        assert all((tmp_path / f"t{s}" / "checkpoint.pt").exists() for s in range(3))
    finally:
        ray.shutdown()


def _drain_ends(inbox: Any, n: int) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += ray.get(inbox.drain.remote()).ends
        time.sleep(0.1)
    return got


@pytest.mark.cluster
def test_out_of_memory_in_the_loop_hands_back_and_alone_fails(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `run()`: an out-of-memory raised by a step (torch's own exception type) hands
    both members back with one slot; a worker of one slot that runs out of memory again has
    nothing left to shrink, so its trial fails with the reason instead of being handed back
    for ever (each hand-back would start a worker that runs out of memory again)."""
    from workers.engine import Engine

    real_iterate = Engine.iterate
    calls = {"n": 0}

    def iterate_then_oom(self: Engine) -> None:
        calls["n"] += 1
        if calls["n"] > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real_iterate(self)

    monkeypatch.setattr(Engine, "iterate", iterate_then_oom)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        inbox = TrialInboxActor.remote()  # type: ignore[attr-defined]

        def item(s: int) -> Assignment:
            return Assignment(s, tiny(seed=s, checkpoint={"dir": str(tmp_path / f"t{s}")}))

        out = SlotWorker("w2", 2, inbox).run([item(0), item(1)])
        assert out.members == 2
        back = _drain_ends(inbox, 2)
        assert sorted(r.trial for r in back) == [0, 1]
        assert all(r == HandedBack("w2", r.trial, 1) for r in back)

        calls["n"] = 0
        SlotWorker("w1", 1, inbox).run([item(0)])
        (result, *rest) = _drain_ends(inbox, 1)
        assert isinstance(result, Failed) and result.trial == 0 and not rest
        assert result.reason.startswith("OutOfMemoryError with one trial in the worker")
        assert "Tried to allocate 2.00 GiB" in result.reason
        assert not (tmp_path / "t0" / "stopped.json").exists()  # a failure, not a stop
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "model",
    [
        {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
        {"n_layers": 4, "n_heads": 4, "d_model": 128, "d_ff": 512},
    ],
)
def test_step_flops_match_torchs_count(model: dict[str, Any]) -> None:
    """`step_flops` (the `fuse: auto` rule's measure) against torch's own FLOP counter over a
    real forward and backward of the trial's GPT, head included."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = tiny(model=model, batch_size=8)
    task = build_task(cfg.task, cfg.seed)
    assert task.vocab_size <= vocab_bound(cfg)
    gpt = build_model(cfg, task)
    x, y = task.train_batch(cfg.batch_size, torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        _, loss = gpt(x, y)
        assert loss is not None
        loss.backward()  # type: ignore[no-untyped-call]
    measured = counter.get_total_flops()
    # torch counts no FLOPs for SDPA on CPU: compare the matmuls, the attention scores
    # (12 x layers x d_model x seq_len per token, the usual estimate) taken off
    m, tokens = cfg.model, cfg.batch_size * cfg.task.seq_len
    scores = 12 * m.n_layers * m.d_model * cfg.task.seq_len * tokens
    est = step_flops(cfg, task.vocab_size) - scores
    assert abs(est - measured) <= 0.02 * measured, (est, measured)


def test_fuse_auto_fuses_small_steps_and_leaves_big_ones_alone() -> None:
    small = tiny()  # quickstart-sized: < 0.1 GFLOP a step
    big = tiny(model={"n_layers": 4, "n_heads": 4, "d_model": 128, "d_ff": 512}, batch_size=32)
    assert step_flops(small) < AUTO_FUSE_MAX_FLOPS < step_flops(big)
    assert auto_fuse(small, gpus=0) == 4
    assert auto_fuse(big, gpus=0) == 1
    assert auto_fuse(big, gpus=0.25) == 8  # on a GPU the memory estimate decides the rest
    assert auto_fuse(tiny(model={"dropout": 0.1}), gpus=0) == 1  # refused by the fused model


def test_fuse_auto_counts_the_head_of_a_language_model() -> None:
    """The Bao study's model (1 layer, d128, word LM with a 2000-word vocabulary) measured no
    faster fused (0.94x): its head is most of the step, and auto leaves it unfused."""
    lm = tiny(
        task={"kind": "lm", "data_dir": "x", "vocab_cap": 2000, "seq_len": 32},
        model={"n_layers": 1, "n_heads": 1, "d_model": 128, "d_ff": 128},
        batch_size=16,
    )
    assert step_flops(lm) > AUTO_FUSE_MAX_FLOPS and auto_fuse(lm, gpus=0) == 1


def test_fuse_auto_leaves_the_dong_grid_points_alone_that_ran_slower_fused() -> None:
    """1 layer, d64, MLP 256, 64 characters x 16: 0.45 GFLOP a step, where 4 fused members
    trained 0.80x the trials/s of one plain trial (bench/archive/fuse_threshold.py); d32 of the same
    shape (0.15 GFLOP) trained 1.16x and stays fused."""
    shape = {"n_layers": 1, "n_heads": 2, "d_ff": 256, "block": "attn_mlp_skip"}
    char = {"kind": "lm", "data_dir": "x", "tokenizer": "char", "vocab_cap": 256, "seq_len": 64}
    slower = tiny(task=char, model={**shape, "d_model": 64}, batch_size=16)
    faster = tiny(task=char, model={**shape, "d_model": 32, "d_ff": 128}, batch_size=16)
    assert auto_fuse(slower, gpus=0) == 1
    assert auto_fuse(faster, gpus=0) == 4
