"""Checkpoint writes (workers/member.py `save_checkpoint`, workers/checkpoints.py) through
real trial processes and real torch: the data is fsynced before the rename and the directory
after it (seen with strace), a failed write (a file-size limit: what a full disk does) leaves
no `checkpoint.tmp`, and one left by a process killed mid-write is gone once the directory is
claimed again, before anything trains."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A trial whose checkpoint (weights and AdamW state) is ~150 MB: its write takes long enough
# to be interrupted, and is far past the file-size limit below.
BIG: dict[str, Any] = {
    "task": {"kind": "copy", "seq_len": 16, "n_valid": 16},
    "model": {"n_layers": 4, "d_model": 512, "n_heads": 8, "d_ff": 2048},
    "batch_size": 2,
    "steps": 4,
    "eval_every": 2,
    "eval_batches": 1,
    "probe_batch_size": 2,
    "device": "cpu",
    "dtype": "float32",
}
SMALL: dict[str, Any] = {
    "task": {"kind": "copy", "seq_len": 16, "n_valid": 16},
    "model": {"n_layers": 1, "d_model": 32, "d_ff": 64},
    "batch_size": 4,
    "steps": 4,
    "eval_every": 2,
    "device": "cpu",
    "dtype": "float32",
}

RUN = """
import json, os, resource, signal, sys, threading, time
import torch
torch.set_num_threads(1)
from workers.config import TrialConfig
from workers.trial import run_trial
config = TrialConfig.model_validate(json.loads(sys.argv[1]))
mode = sys.argv[2]
tmp = os.path.join(config.checkpoint.dir, "checkpoint.tmp")
seen = []

class Watch:
    def report(self, step, metrics, value):
        seen.append(os.path.exists(tmp))
        return None

if mode == "fsize":  # writes past 1 MiB fail with EFBIG, as on a full disk
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
if mode == "kill":  # SIGKILL this process the moment a checkpoint write has begun
    def watch():
        while not os.path.exists(tmp):
            time.sleep(0.0002)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()
try:
    run_trial(config, Watch())
    print(json.dumps({"ok": True, "seen": seen}))
except Exception as e:  # torch wraps the EFBIG of its writer in a RuntimeError
    print(json.dumps({"ok": False, "error": str(e)[:300], "seen": seen}))
"""


def run(config: dict[str, Any], ckpt: Path, mode: str, prefix: list[str] | None = None) -> Any:
    cfg = {**config, "checkpoint": {"dir": str(ckpt), "owner": "study-1/trial-0"}}
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-c", RUN, json.dumps(cfg), mode],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    return proc


def test_a_failed_checkpoint_write_leaves_no_tmp(tmp_path: Path) -> None:
    ckpt = tmp_path / "trial-0"
    proc = run(BIG, ckpt, "fsize")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["ok"] and out["seen"] == [False], out  # the first save failed
    assert not (ckpt / "checkpoint.tmp").exists(), sorted(p.name for p in ckpt.iterdir())
    assert not (ckpt / "checkpoint.pt").exists()


def test_a_tmp_left_by_a_killed_write_is_removed_when_the_trial_is_claimed(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "trial-0"
    killed = run(BIG, ckpt, "kill")
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    assert (ckpt / "checkpoint.tmp").exists()  # what the interrupted write left
    # The next execution of the same trial (same owner): at its first report, before it
    # saves anything (every_evals 2), the stray file is already gone.
    again = run({**BIG, "steps": 2}, ckpt, "plain")
    assert again.returncode == 0, again.stderr[-2000:]
    out = json.loads(again.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["seen"] == [False], out
    assert not (ckpt / "checkpoint.tmp").exists()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_checkpoint_data_and_rename_are_fsynced(tmp_path: Path) -> None:
    ckpt = tmp_path / "trial-0"
    log = tmp_path / "strace.log"
    trace = [
        "strace",
        "-f",
        "-qq",
        "-e",
        "trace=openat,open,fsync,fdatasync,rename,renameat,renameat2",
    ]
    proc = run(SMALL, ckpt, "plain", [*trace, "-o", str(log)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"]
    tmp, final = str(ckpt / "checkpoint.tmp"), str(ckpt / "checkpoint.pt")
    fds: dict[tuple[str, str], str] = {}  # (pid, fd) -> path
    synced: set[str] = set()
    renames = dir_synced_after = 0
    pending_dir = False
    for line in log.read_text().splitlines():
        pid = line.split(" ", 1)[0]
        if m := re.search(r'open(?:at)?\((?:AT_FDCWD, )?"([^"]+)".*\) = (\d+)$', line):
            fds[(pid, m.group(2))] = m.group(1)
        elif m := re.search(r"f(?:data)?sync\((\d+)\)\s+= 0", line):
            path = fds.get((pid, m.group(1)), "")
            synced.add(path)
            if pending_dir and path == str(ckpt):
                dir_synced_after += 1
                pending_dir = False
        elif re.search(rf'rename(?:at2?)?\(.*"{re.escape(tmp)}".*"{re.escape(final)}".*= 0', line):
            assert tmp in synced, "checkpoint.tmp renamed before its data was fsynced"
            synced.discard(tmp)
            renames += 1
            pending_dir = True
    assert renames == 2, log.read_text()[-3000:]  # steps 2 and 4
    assert dir_synced_after == renames, "the directory was not fsynced after the rename"
