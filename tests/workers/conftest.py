"""Shared fixtures for the trial-engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads and suffer badly on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A Ray of this process (no head, no job server) for the inbox's tests."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
