"""The `qkscope` CLI: the README's run path (`serve --run FILE --exit-when-done` brings up a
local Ray head and the API, runs the study, prints the results table, tears Ray down), one-line
errors with a hint, and no orphaned Ray head after a `kill -9` of `serve` (`qkscope stop`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from sqlalchemy import Engine

from service.config import Settings
from tests.conftest import ROOT, free_port
from tests.service.conftest import TOKEN, live_api
from tests.service.helpers import cli_env, qkscope, ray_left


def test_server_down_and_missing_file_are_one_line_with_a_hint(tmp_path: Path) -> None:
    env = cli_env(tmp_path / "home", f"http://127.0.0.1:{free_port()}")
    down = qkscope("status", "1", env=env, cwd=tmp_path)
    assert down.returncode == 1 and down.stdout == ""
    assert len(down.stderr.strip().splitlines()) == 1, down.stderr
    assert "qkscope serve" in down.stderr and "QKSCOPE_API_URL" in down.stderr
    assert "Traceback" not in down.stderr
    missing = qkscope("submit", "nope.yaml", env=env, cwd=tmp_path)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [missing.stderr.strip()]
    assert "nope.yaml" in missing.stderr
    no_run = qkscope("serve", "--run", "nope.yaml", env=env, cwd=tmp_path)
    assert no_run.returncode == 1 and "nope.yaml" in no_run.stderr
    assert len(no_run.stderr.strip().splitlines()) == 1, no_run.stderr


def test_api_errors_are_printed_once(
    app_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "budget": {"n_trials": 0}}))
    with live_api(app_settings, monkeypatch) as url:
        env = cli_env(tmp_path / "home", url)
        env["QKSCOPE_API_TOKEN"] = TOKEN
        r = qkscope("submit", str(bad), env=env, cwd=tmp_path)
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.count("budget.n_trials") == 1, r.stderr
        assert r.stderr.startswith("qkscope: error 422:") and len(r.stderr.splitlines()) == 1
        env["QKSCOPE_API_TOKEN"] = "wrong"
        r = qkscope("results", "1", env=env, cwd=tmp_path)
        assert r.returncode == 1 and "error 401" in r.stderr and "QKSCOPE_API_TOKEN" in r.stderr
        assert len(r.stderr.splitlines()) == 1


@pytest.mark.cluster
def test_serve_runs_a_study_and_prints_results(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    spec["budget"]["n_trials"] = 2
    spec["base"]["steps"] = 40
    spec["base"]["eval_every"] = 20
    study = tmp_path / "small.yaml"
    study.write_text(yaml.safe_dump(spec))
    api_port, ray_port = free_port(), free_port()
    env = cli_env(tmp_path / "home", f"http://127.0.0.1:{api_port}")
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--run", str(study), "--exit-when-done",
        "--port", str(api_port), "--dashboard-port", str(free_port()),
        "--ray-port", str(ray_port), "--num-cpus", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    assert "study 1 'quickstart': COMPLETED, 2/2 trials" in out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert "min_H_norm" in header and "trapped" in header and "regularizer.lambda" in header
    assert "pen_v" in header
    rows = [
        line
        for line in out.splitlines()
        if line.split()[:2] in (["0", "COMPLETE"], ["1", "COMPLETE"])
    ]
    assert len(rows) == 2
    # Not a terminal: plain progress lines, each different from the one before, no bar.
    assert "\r" not in err and "started the local Ray head" in err
    progress = [line for line in err.splitlines() if line.startswith("study 1: ")]
    assert progress and progress[-1].startswith("study 1: COMPLETED, 2/2 finished")
    assert all(a != b for a, b in zip(progress, progress[1:], strict=False))
    # The embedded default wrote its SQLite database and a private Ray token under home.
    home = tmp_path / "home"
    assert (home / "qkscope.db").exists()
    assert (home / "ray_auth_token").stat().st_mode & 0o077 == 0
    # Ray was stopped with the service: no raylet of this session, no state left behind.
    assert not ray_left(ray_port)
    assert not (home / "ray-head.json").exists() and not (home / "serve.json").exists()


def start_serve(
    env: dict[str, str], cwd: Path, api_port: int, ray_port: int, dash: int
) -> tuple[subprocess.Popen[str], list[str]]:
    cmd = [
        sys.executable, "-m", "service.cli", "serve", "--port", str(api_port),
        "--dashboard-port", str(dash), "--ray-port", str(ray_port), "--num-cpus", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:  # until the API is up (or serve died)
        lines.append(line)
        if line.startswith("qkscope API on"):
            break
    assert proc.poll() is None, "".join(lines)
    return proc, lines


@pytest.mark.cluster
def test_kill_9_then_serve_reuses_the_head_and_stop_leaves_nothing(tmp_path: Path) -> None:
    api_port, ray_port, dash = free_port(), free_port(), free_port()
    env = cli_env(tmp_path / "home", f"http://127.0.0.1:{api_port}")
    first, said = start_serve(env, tmp_path, api_port, ray_port, dash)
    try:
        assert any("started the local Ray head" in s for s in said), said
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert ray_left(ray_port)  # the head outlives a kill -9 of serve...
        second, said = start_serve(env, tmp_path, api_port, ray_port, free_port())
        # ...and the next serve says it reuses it (on the head's own ports).
        assert any("reusing the local Ray head" in s for s in said), said
        assert not any("starting a local Ray head" in s for s in said), said
        assert f"Ray dashboard http://127.0.0.1:{dash}" in said[-1]
        stopped = qkscope("stop", env=env, cwd=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped qkscope serve" in stopped.stdout
        assert second.wait(timeout=90) == 0  # `stop` is a SIGTERM: a clean exit
        assert not ray_left(ray_port)
        again = qkscope("stop", env=env, cwd=tmp_path)
        assert "nothing of qkscope's is running" in again.stdout
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
        if ray_left(ray_port):
            qkscope("stop", env=env, cwd=tmp_path)


@pytest.mark.cluster
def test_stop_ends_a_head_orphaned_by_kill_9(tmp_path: Path) -> None:
    api_port, ray_port = free_port(), free_port()
    env = cli_env(tmp_path / "home", f"http://127.0.0.1:{api_port}")
    proc, said = start_serve(env, tmp_path, api_port, ray_port, free_port())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ray_left(ray_port)
    r = qkscope("stop", env=env, cwd=tmp_path)
    assert r.returncode == 0 and "stopped the local Ray head" in r.stdout, r.stdout + r.stderr
    deadline = time.monotonic() + 30  # pgrep may still see exiting children for a moment
    while ray_left(ray_port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_left(ray_port)


def test_lr_sensitivity_table(
    app_settings: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.service.lr_seed import (
        E2E_GRID,
        SEEDS,
        expected_group,
        final_of,
        l0_of,
        seed_lr_study,
    )

    sid = seed_lr_study(engine, "cli-lr-sens")
    with live_api(app_settings, monkeypatch) as url:
        env = cli_env(tmp_path / "home", url)
        env["QKSCOPE_API_TOKEN"] = TOKEN
        r = qkscope("lr-sensitivity", str(sid), "--group-by", "model.qk_norm", env=env,
                    cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith(f"study {sid}: LR sensitivity") and "model.qk_norm" in lines[0]
        for norm in ("none", "layernorm"):
            want = expected_group(norm)
            (row,) = [ln for ln in lines if ln.startswith(f"model.qk_norm={norm} ")]
            assert f"{want['mean']:.4g}" in row
            assert f"[{want['lo']:.4g}, {want['hi']:.4g}]" in row
            l_star = [
                min(l0_of(norm, s) if v is None else v
                    for v in (final_of(norm, s, eta) for eta in E2E_GRID))
                for s in SEEDS
            ]  # fmt: skip
            assert f"{sum(l_star) / len(l_star):.4g}" in row  # l*, beside the unigram floor
        assert any("seed 3 left out" in ln and "RUNNING" in ln for ln in lines)
        assert any(ln.startswith("1 ") and "3d" in ln for ln in lines)  # lr 1: 3 diverged
        bad = qkscope("lr-sensitivity", str(sid), "--group-by", "nope", env=env, cwd=tmp_path)
        assert bad.returncode == 1 and "error 422" in bad.stderr and "nope" in bad.stderr
        js = qkscope("lr-sensitivity", str(sid), "--json", env=env, cwd=tmp_path)
        assert js.returncode == 0 and '"groups"' in js.stdout


def test_stability_boundary_table(
    app_settings: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import math

    from tests.service.boundary_seed import GRID, bracket, seed_boundary_study

    sid = seed_boundary_study(engine, "cli-boundary")
    with live_api(app_settings, monkeypatch) as url:
        env = cli_env(tmp_path / "home", url)
        env["QKSCOPE_API_TOKEN"] = TOKEN
        r = qkscope("stability-boundary", str(sid), "--target-width", "512", env=env,
                    cwd=tmp_path)  # fmt: skip
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].startswith(f"study {sid}: stability boundary") and "512" in lines[0]
        lo, hi = bracket("none", 128, 1, GRID)
        (row,) = [ln for ln in lines if ln.startswith("model.qk_norm=none") and " 128 " in ln
                  and ln.split()[2] == "1"]  # fmt: skip
        assert f"{math.sqrt(lo * hi):.4g}" in row
        assert any("eta_max" in ln and ln.startswith("model.qk_norm=layernorm") for ln in lines)
        assert any("do not reach" in ln for ln in lines)  # layernorm at width 32
        bad = qkscope("stability-boundary", str(sid), "--tau", "3", env=env, cwd=tmp_path)
        assert bad.returncode == 1 and "error 422" in bad.stderr and "tau" in bad.stderr
