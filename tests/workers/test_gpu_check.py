"""A trial that Ray gave GPUs fails loudly when torch cannot use CUDA where it landed, instead
of quietly training on the CPU while Ray counts the GPU as busy."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from workers.remote import TrialInbox, check_gpus, run_trial_task
from workers.trial import TrialConfig

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="needs a node where CUDA is NOT available"
)


def test_no_gpus_asked_is_fine() -> None:
    check_gpus([], "here")


def test_gpus_without_cuda_raise_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"GPU ids \[0\].*CUDA is not available.*`gpu` target"):
        check_gpus([0], "node-a")


@pytest.mark.cluster
def test_trial_task_on_a_gpu_node_without_cuda_fails_loudly() -> None:
    """A real Ray node that advertises a GPU (as a node with CPU-only torch would)."""
    ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        inbox = TrialInbox.remote()  # type: ignore[attr-defined]
        config = TrialConfig.model_validate({"steps": 2, "eval_every": 1}).model_dump(
            mode="json", by_alias=True
        )
        task = ray.remote(run_trial_task).options(num_gpus=1, num_cpus=1, max_retries=0)
        with pytest.raises(ray.exceptions.RayTaskError, match="CUDA is not available"):
            ray.get(task.remote(config, 0, inbox), timeout=120)
        # It announced its start first (fire-and-forget), so the runner knows where it failed.
        starts: list[tuple[object, ...]] = []
        deadline = time.monotonic() + 30
        while not starts and time.monotonic() < deadline:
            reports, starts, _finished = ray.get(inbox.drain.remote())
            assert reports == []
            time.sleep(0.2)
        assert [s[0] for s in starts] == [0]
    finally:
        ray.shutdown()
