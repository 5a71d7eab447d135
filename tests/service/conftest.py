"""Fixtures shared by the service tests: a real local Ray head (token auth, job server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.ray_cluster import LocalRayHead
from tests.conftest import free_port


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRayHead]:
    head = LocalRayHead(
        tmp_path_factory.mktemp("rayhome"),
        gcs_port=free_port(),
        dashboard_port=free_port(),
        num_cpus=2,
    )
    head.start()
    try:
        yield head
    finally:
        head.stop()
