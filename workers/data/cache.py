"""Where the data forms keep what they compute once per corpus (a trained BPE, the token ids of
a split, the Arrow files `datasets` builds), and how several trials share it safely; torch-free.

The cache directory is, in order: `$QKSCOPE_DATA_CACHE` (on the workers) when set; else
`<data_dir>/.qkscope-cache/`; else, where the data directory is read-only,
`$XDG_CACHE_HOME/qkscope` (`~/.cache/qkscope`). Every entry is named by a content hash of its
inputs (the training text and the settings), so an edited corpus or a new setting never
reads a stale entry, and the directory can be deleted at any time.

Trials of a study start together: the first to need an entry takes an exclusive lock on
`<entry>.lock` (`fcntl.flock`) and builds it while the others wait on the lock, then read
what it wrote. An entry is written to a temporary file of its own and renamed into place
(`workers.checkpoints.durable_write`), so a reader never sees a partial file, even where
locks do not work (some network file systems): the worst case there is the same entry
built twice, with the same content.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from workers.checkpoints import durable_write

__all__ = ["CACHE_ENV", "CACHE_SUBDIR", "cache_dir", "content_key", "locked", "write_atomic"]

CACHE_ENV = "QKSCOPE_DATA_CACHE"
"""Environment variable: the cache directory of every data form on this worker."""

CACHE_SUBDIR = ".qkscope-cache"
"""The cache directory inside a data directory (the default where it is writable)."""


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def cache_dir(data_dir: Path) -> Path:
    """The cache directory for the corpus in `data_dir` (created; see the module's doc)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        path = Path(env).expanduser()
        if not _writable(path):
            raise OSError(f"{CACHE_ENV}={env} is not a writable directory")
        return path
    inside = data_dir / CACHE_SUBDIR
    if _writable(inside):
        return inside
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkscope"
    if not _writable(home):
        raise OSError(
            f"no writable cache directory: {inside} and {home} are not writable; set {CACHE_ENV}"
        )
    return home


def content_key(**parts: Any) -> str:
    """A sha256 (hex) of `parts` as canonical JSON: the name of a cache entry."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `<path>.lock` (blocks while another process holds it)."""
    lock = path.with_name(path.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def write_atomic(path: Path, write: Callable[[IO[Any]], object], *, binary: bool) -> None:
    """Write `path` through a temporary file of this writer's own, renamed into place."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    durable_write(path, write, binary=binary, tmp=tmp)
