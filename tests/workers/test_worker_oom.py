"""A slot worker's task that runs out of memory where it cannot hand its members back itself
(outside an admission or a step) ends as `WorkerOutOfMemory`, the type the runner shrinks
the worker's key on (service/runner/pool.py, `out_of_memory`); any other error ends it as
itself. No Ray: the worker's loop is replaced by one that raises."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers import slot_worker
from workers.messages import Assignment, WorkerDone, WorkerOutOfMemory


def _worker_raising(error: BaseException, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(slot_worker, "node_name", lambda: "node")

    class Raises(slot_worker.SlotWorker):
        def run(self, first: list[Assignment]) -> WorkerDone:
            raise error

    return Raises("w", 2, inbox=None)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: 1 TiB"),
    ],
)
def test_an_out_of_memory_ends_the_task_as_worker_out_of_memory(
    error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(WorkerOutOfMemory) as raised:
        _worker_raising(error, monkeypatch).run_settled([])
    assert raised.value.__cause__ is error
    assert str(raised.value).startswith(type(error).__name__)


def test_any_other_error_ends_the_task_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    error = RuntimeError("a fused step failed with several members")
    with pytest.raises(RuntimeError) as raised:
        _worker_raising(error, monkeypatch).run_settled([])
    assert raised.value is error
