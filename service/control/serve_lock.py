"""One `qkscope serve` per home, and a record of it that `qkscope stop` can find.

`serve` takes an exclusive `flock` on `<home>/serve.lock` before it touches anything (the
Ray head, the database, a port) and holds it until it exits; the kernel drops the lock
when the process dies, however it dies, so a record left by a dead `serve` never blocks
the next one. While it holds the lock it keeps `<home>/serve.json` up to date: its pid,
API URL and the Ray head it uses (and whether it owns that head, i.e. started it or took
it over from a `serve` that died). A second `serve` in the same home reads that record and
refuses, naming the running one; it never stops a head it did not start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SERVE_LOCK", "SERVE_STATE", "ServeLock", "ServeRunning", "running_serve"]

SERVE_LOCK = "serve.lock"
SERVE_STATE = "serve.json"


class ServeRunning(RuntimeError):
    """Another `qkscope serve` holds this home."""

    def __init__(self, home: Path, record: dict[str, Any] | None) -> None:
        self.home = home
        self.record = record or {}
        pid = self.record.get("pid", "unknown")
        url = self.record.get("api_url", "unknown URL")
        super().__init__(
            f"another `qkscope serve` is already running for home {home} "
            f"(pid {pid}, API {url}); stop it with `qkscope stop`, or use another "
            "QKSCOPE_HOME"
        )


def _read_record(home: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((home / SERVE_STATE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _try_lock(home: Path) -> int | None:
    """An fd holding the home's lock, or None when another process holds it."""
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / SERVE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def running_serve(home: Path) -> dict[str, Any] | None:
    """The record of the `serve` that holds `home` (`{}` if it has written none yet), or
    None when no live `serve` holds it: a record left by a dead one is ignored."""
    if not (home / SERVE_LOCK).exists():
        return None
    fd = _try_lock(home)
    if fd is None:
        return _read_record(home) or {}
    os.close(fd)  # nobody held it: whatever serve.json says is stale
    return None


@dataclass
class ServeLock:
    """The lock and record of the running `serve` (a context manager)."""

    home: Path
    record: dict[str, Any] = field(default_factory=dict)
    _fd: int | None = None

    def acquire(self) -> None:
        """Take the home or raise `ServeRunning` naming the `serve` that has it."""
        fd = _try_lock(self.home)
        if fd is None:
            raise ServeRunning(self.home, _read_record(self.home))
        self._fd = fd
        self.update(pid=os.getpid())

    def update(self, **fields: Any) -> None:
        """Merge `fields` into serve.json (written whole, then renamed: never half a file)."""
        self.record.update(fields)
        path = self.home / SERVE_STATE
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.record))
        os.replace(tmp, path)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            record = _read_record(self.home)
            if record is not None and record.get("pid") == os.getpid():
                (self.home / SERVE_STATE).unlink()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> ServeLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
