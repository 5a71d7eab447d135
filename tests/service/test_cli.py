"""The README's run path: `qkscope serve --run FILE --exit-when-done` brings up a local Ray
head (token auth) and the API, runs the study to completion, prints the results table, and
tears Ray down again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.cluster


def test_serve_runs_a_study_and_prints_results(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    spec["budget"]["n_trials"] = 2
    spec["base"]["steps"] = 40
    spec["base"]["eval_every"] = 20
    study = tmp_path / "small.yaml"
    study.write_text(yaml.safe_dump(spec))
    api_port, ray_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QKSCOPE_", "RAY_"))}
    env["QKSCOPE_HOME"] = str(tmp_path / "home")
    env["QKSCOPE_API_URL"] = f"http://127.0.0.1:{api_port}"
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--run", str(study), "--exit-when-done",
        "--port", str(api_port), "--dashboard-port", str(free_port()),
        "--ray-port", str(ray_port), "--num-cpus", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "study 1 'quickstart': COMPLETED, 2/2 trials" in out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert "min_H_norm" in header and "regularizer.lambda" in header
    rows = [
        line
        for line in out.splitlines()
        if line.split()[:2] in (["0", "COMPLETE"], ["1", "COMPLETE"])
    ]
    assert len(rows) == 2
    # The embedded default wrote its SQLite database and a private Ray token under home.
    home = tmp_path / "home"
    assert (home / "qkscope.db").exists()
    assert (home / "ray_auth_token").stat().st_mode & 0o077 == 0
    # Ray was stopped with the service: no raylet of this session is left.
    left = subprocess.run(["pgrep", "-f", f"gcs_server_port={ray_port}"], capture_output=True)
    assert left.returncode == 1
