"""A trial's checkpoint directory: whose it is, and whether the trial has stopped; torch-free.

The directory (`TrialConfig.checkpoint.dir`) holds the trial's weights (`checkpoint.pt`, written
by workers/member.py through `durable_write`, below), its report journal (`reports.jsonl`,
workers/inbox.py) and two small files kept here:

- `owner`: who the directory belongs to (`CheckpointConfig.owner`, e.g. a study's unique id
  and the trial number). A directory found with another owner is an old run's (a database
  reset that made a new study 1 / trial 0, say): it is emptied before anything is read, so a
  new trial never resumes foreign weights or replays a foreign journal.
- `stopped.json`: the trial's final status and summary, written the moment it stops (pruned,
  diverged, completed) and before its slot trains anything else. Every later execution (a
  Ray retry, a runner restart, a slot worker that picks the trial up again) finds it and
  returns the recorded summary without training: a stopped trial never trains again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "OWNER_FILE",
    "STOPPED_FILE",
    "claim_dir",
    "durable_write",
    "fsync_dir",
    "read_stopped",
    "remove_stray_tmp",
    "write_stopped",
]

OWNER_FILE = "owner"
STOPPED_FILE = "stopped.json"


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (POSIX: the new name is in the directory's data,
    which its own fsync flushes)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stray_tmp(directory: Path) -> None:
    """Remove the `*.tmp` files an interrupted write left (a crash or a kill between write
    and rename): they are never read, and a partial checkpoint can be large."""
    if directory.is_dir():
        for stray in directory.glob("*.tmp"):
            stray.unlink(missing_ok=True)


def durable_write(
    path: Path,
    write: Callable[[IO[Any]], object],
    *,
    binary: bool = False,
    tmp: Path | None = None,
) -> None:
    """Write `path` atomically and durably: `write` fills a temporary file (`tmp`, by default
    `<name>.tmp` beside it; opened in binary mode with `binary`), which is flushed, fsynced
    and renamed over `path`, then the directory is fsynced. A crash or a power loss leaves the
    old file or the new one, whole (without the fsyncs the rename can reach the disk before
    the data: an empty or partial file after a power loss). A failed write (a full disk, or
    whatever `write` raises) removes the temporary file and raises; one left by a kill
    mid-write is removed when the directory is next claimed (`claim_dir`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp") if tmp is None else tmp
    try:
        with tmp.open("wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _write_text(path: Path, text: str) -> None:
    durable_write(path, lambda f: f.write(text))


def claim_dir(directory: str | Path | None, owner: str | None) -> bool:
    """Make `directory` belong to `owner`; returns True when a foreign run's files were removed.

    Without an owner (a trial run by hand) nothing is checked: the directory is the caller's.
    """
    if directory is None or owner is None:
        return False
    d = Path(directory)
    marker = d / OWNER_FILE
    if marker.exists() and marker.read_text() == owner:
        remove_stray_tmp(d)  # ours: what an interrupted write of the last execution left
        return False
    wiped = d.exists() and any(d.iterdir())
    if wiped:
        shutil.rmtree(d)
    _write_text(marker, owner)
    return wiped


def write_stopped(directory: str | Path | None, record: dict[str, Any]) -> None:
    """Record that the trial stopped (status, step, summary): durable before this returns."""
    if directory is not None:
        _write_text(Path(directory) / STOPPED_FILE, json.dumps(record))


def read_stopped(directory: str | Path | None) -> dict[str, Any] | None:
    """The stop record of a trial that already stopped, or None."""
    if directory is None:
        return None
    path = Path(directory) / STOPPED_FILE
    if not path.exists():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    return record
