"""Which ends of a worker's task were a lack of memory (service/runner/pool.py,
`out_of_memory`): told by the error's type, never by its text; no Ray cluster needed."""

from __future__ import annotations

import ray
from ray.exceptions import RayTaskError

from service.runner.pool import out_of_memory
from workers.messages import WorkerOutOfMemory


def _task_error(cause: Exception) -> RayTaskError:
    """What `ray.get` raises for a task that raised `cause` (after Ray's round trip)."""
    error = RayTaskError("run_slot_worker_task", "Traceback ...", cause, "p", 1, "127.0.0.1")
    return error.as_instanceof_cause()


def test_rays_memory_monitor_kill_is_out_of_memory() -> None:
    assert out_of_memory(ray.exceptions.OutOfMemoryError("Task was killed due to low memory"))


def test_a_worker_out_of_memory_is_out_of_memory() -> None:
    assert out_of_memory(_task_error(WorkerOutOfMemory("OutOfMemoryError: CUDA out of memory")))
    # a RayTaskError that could not take the cause's type still carries it as `cause`
    plain = RayTaskError("f", "tb", WorkerOutOfMemory("MemoryError"), "p", 1, "127.0.0.1")
    assert out_of_memory(plain)


def test_other_errors_are_not_whatever_they_say() -> None:
    assert not out_of_memory(_task_error(RuntimeError("OutOfMemoryError in a log line")))
    assert not out_of_memory(ray.exceptions.NodeDiedError("OutOfMemoryError"))
    assert not out_of_memory(ValueError("OutOfMemoryError"))
