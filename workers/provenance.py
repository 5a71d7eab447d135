"""Where a trial's numbers came from: a hash of its config and the code commit that ran it.

Both go into every `TrialSummary`, so a stored or exported result row can be traced to the
exact settings and code (docs/reproductions.md, "Records"). Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from workers.config import TrialConfig

__all__ = ["COMMIT_ENV", "code_commit", "config_hash"]

COMMIT_ENV = "QKSCOPE_CODE_COMMIT"
"""Set it where the code has no git checkout (an image): its value is taken as the commit."""

_REPO = Path(__file__).resolve().parents[1]


def config_hash(config: TrialConfig) -> str:
    """sha256 (first 16 hex digits) of the config as canonical JSON, without `checkpoint`
    and `task.data_root` (where a run keeps its checkpoints, or the data directory it was
    confined to, says nothing about what it computes)."""
    exclude: dict[str, Any] = {"checkpoint": True, "task": {"data_root"}}
    model: set[str] = set()
    if config.model.kind == "builtin":  # the hash of a builtin config predates model kinds
        model |= {"kind", "hf"}
    # Options added later leave the hash of a config that does not use them unchanged.
    if config.model.qkv_init == "normal":
        model.add("qkv_init")
    if model:
        exclude["model"] = model
    if config.optim.min_lr is None:
        exclude["optim"] = {"min_lr"}
    data = config.model_dump(mode="json", by_alias=True, exclude=exclude)
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@functools.cache
def code_commit() -> str | None:
    """The commit of the code this process runs: `$QKSCOPE_CODE_COMMIT`, else `git rev-parse
    HEAD` of the checkout `workers/` lives in, with "+dirty" when a tracked file differs from
    it; None when neither is available."""
    if env := os.environ.get(COMMIT_ENV):
        return env

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(_REPO), *args], capture_output=True, text=True, timeout=30
        )
        if out.returncode != 0:
            raise OSError(out.stderr.strip())
        return out.stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head
