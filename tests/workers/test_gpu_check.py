"""A trial that Ray gave GPUs fails loudly when torch cannot use CUDA where it landed, instead
of quietly training on the CPU while Ray counts the GPU as busy."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from workers.inbox import TrialInboxActor
from workers.messages import Assignment
from workers.slot_worker import check_gpus, run_slot_worker_task
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
def test_slot_worker_on_a_gpu_node_without_cuda_fails_loudly() -> None:
    """A real Ray node that advertises a GPU (as a node with CPU-only torch would): the worker
    fails before it starts any trial (the runner counts that loss against each trial's
    `max_retries`: tests/service/runner/test_scheduler.py)."""
    ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        inbox = TrialInboxActor.remote()  # type: ignore[attr-defined]
        config = TrialConfig.model_validate({"steps": 2, "eval_every": 1})
        task = ray.remote(run_slot_worker_task).options(num_gpus=1, num_cpus=1, max_retries=0)
        with pytest.raises(ray.exceptions.RayTaskError, match="CUDA is not available"):
            ray.get(task.remote("w", 1, [Assignment(0, config)], inbox), timeout=120)
        time.sleep(0.5)
        assert not ray.get(inbox.drain.remote())  # it trained nothing, said nothing
    finally:
        ray.shutdown()
