"""The embedded `qkscope serve` guards its Ray head (issue 21, item 5), with real processes.

The sequence a new user hit in one folder: `serve` running, a second `serve` started there,
which adopted the first one's head, failed to bind the API port and stopped the head on its
way out; `qkscope stop` then found nothing, and studies sat PENDING without a word. Here: the
second `serve` refuses before it touches anything and names the first; the first keeps
working and `stop` finds it; a head that dies under a running `serve` is restarted, and when
it cannot be, `serve` exits non-zero, loudly; and while Ray's job server does not answer, a
study says so in `waiting_reason` (API, client, CLI).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from qkscope import Client
from qkscope.progress import summary_line
from service.store.models import Study, StudyStatus
from service.store.session import make_engine, make_sessionmaker, session_scope
from service.store.studies import RAY_UNREACHABLE, StudyRows
from tests.conftest import ROOT, free_port
from tests.service.helpers import cli_env, qkscope, ray_left


def tiny_study() -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    spec["name"] = "guard"
    spec["budget"] = {"n_trials": 1}
    spec["base"]["steps"] = 20
    spec["base"]["eval_every"] = 10
    return dict(spec)


class Serve:
    """`qkscope serve` in a child process; its stderr is collected by a thread."""

    def __init__(self, env: dict[str, str], cwd: Path, *args: str) -> None:
        cmd = [sys.executable, "-m", "service.cli", "serve", *args]
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader may still be draining the pipe
                if not any(text in ln for ln in self.lines):
                    break
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} from serve; it said:\n{''.join(self.lines)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve_args(api: int, ray: int, dash: int) -> list[str]:
    return ["--port", str(api), "--ray-port", str(ray), "--dashboard-port", str(dash)]


class Squatter:
    """Another program on 127.0.0.1:port: it listens (so `ray start` cannot bind there) and
    closes every connection at once (a silent listener would hang the HTTP client that
    waits for the head's job server)."""

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # bound as soon as the port is free
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self.sock.bind(("127.0.0.1", port))
                self.sock.listen()
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        threading.Thread(target=self._refuse, daemon=True).start()

    def _refuse(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.mark.cluster
def test_serve_refuses_a_second_serve_restarts_a_dead_head_and_exits_when_it_cannot(
    tmp_path: Path,
) -> None:
    """One `serve` through the three guards, in order: (1) a second `serve` in the same home
    refuses before it touches anything and names the first, which keeps working; (2) its
    head's GCS is killed: the watchdog restarts the head and studies launch on the new one;
    (3) the whole head is killed and another program takes its dashboard port, so every
    restart on the same ports fails (`ray start` refuses an occupied dashboard port): after
    three failed restarts `serve` says why on stderr, exits non-zero and leaves no Ray, no
    lock and no record behind; `stop` then finds nothing, even beside a stale record."""
    api, ray, dash = free_port(), free_port(), free_port()
    home = tmp_path / "home"
    env = cli_env(home, f"http://127.0.0.1:{api}")
    env["QKSCOPE_HEAD_CHECK_INTERVAL_S"] = "1"
    env["QKSCOPE_RECONCILE_INTERVAL_S"] = "1"
    first = Serve(env, tmp_path, *serve_args(api, ray, dash), "--num-cpus", "1")
    squatter = None
    try:
        first.wait_for("qkscope API on")
        head_state = (home / "ray-head.json").read_text()
        record = json.loads((home / "serve.json").read_text())
        assert record["pid"] == first.proc.pid and record["owns_head"] is True
        assert record["api_url"] == f"http://127.0.0.1:{api}"

        # (1) A second serve refuses and leaves the first as it was.
        started = time.monotonic()
        second = qkscope(
            "serve", *serve_args(free_port(), free_port(), free_port()), env=env, cwd=tmp_path
        )
        assert second.returncode == 1
        assert f"pid {first.proc.pid}" in second.stderr, second.stderr
        assert f"http://127.0.0.1:{api}" in second.stderr, second.stderr
        assert "Ray head" not in second.stderr  # it neither adopted nor started one
        assert time.monotonic() - started < 30
        assert ray_left(ray) and (home / "ray-head.json").read_text() == head_state
        assert json.loads((home / "serve.json").read_text())["pid"] == first.proc.pid
        with Client(f"http://127.0.0.1:{api}") as qk:  # API healthy, jobs launch
            study = qk.submit(tiny_study())
            assert study.ray_job_id is not None and study.waiting_reason is None
            qk.cancel(study.id)

        # (2) The head's GCS dies: the watchdog restarts the head on the same ports.
        old_head = json.loads(head_state)["pid"]
        gcs = subprocess.run(
            ["pgrep", "-f", f"gcs_server_port={ray}"], capture_output=True, text=True
        ).stdout.split()
        assert gcs
        for pid in gcs:
            os.kill(int(pid), signal.SIGKILL)
        first.wait_for(f"the local Ray head (pid {old_head}) died; restarting it", 30)
        first.wait_for("restarted the local Ray head", 120)
        new_head = json.loads((home / "ray-head.json").read_text())
        assert new_head["pid"] != old_head and new_head["serve_pid"] == first.proc.pid
        assert first.proc.poll() is None
        with Client(f"http://127.0.0.1:{api}") as qk:  # studies launch on the new head
            study = qk.submit(tiny_study())
            assert study.ray_job_id is not None and study.waiting_reason is None
            qk.cancel(study.id)

        # (3) The head dies and cannot come back: serve gives up loudly.
        os.killpg(new_head["pid"], signal.SIGKILL)  # `ray start --block` leads the group
        squatter = Squatter(dash)
        first.wait_for(f"the local Ray head (pid {new_head['pid']}) died; restarting it", 30)
        for n in (1, 2, 3):
            first.wait_for(f"restarting the local Ray head failed ({n})", 120)
        assert first.proc.wait(timeout=120) == 1
        said = "".join(first.lines)
        assert "qkscope serve: the local Ray head died and 3 restarts failed" in said, said
        assert str(home / "logs" / "ray-head.log") in said
        assert said.rstrip().splitlines()[-1].startswith("qkscope: the local Ray head died")
        assert "Traceback" not in said
        assert not ray_left(ray)
        assert not (home / "serve.json").exists()  # the lock and record are released
        stopped = qkscope("stop", env=env, cwd=tmp_path)
        assert "nothing of qkscope's is running" in stopped.stdout, stopped
        # A serve that died leaves its record behind: it does not block the next one.
        (home / "serve.json").write_text(json.dumps({"pid": 999_999_999, "api_url": "x"}))
        again = qkscope("stop", env=env, cwd=tmp_path)
        assert "nothing of qkscope's is running" in again.stdout, again
    finally:
        if squatter is not None:
            squatter.close()
        first.kill()
        if ray_left(ray):
            qkscope("stop", env=env, cwd=tmp_path)


def test_unreachable_ray_shows_in_waiting_reason_api_client_and_cli(tmp_path: Path) -> None:
    """An external QKSCOPE_RAY_ADDRESS where nothing listens: the POST still stores the study
    (the reconciler launches it once Ray answers) but says why it is not starting."""
    api = free_port()
    url = f"http://127.0.0.1:{api}"
    env = cli_env(tmp_path / "home", url)
    env["QKSCOPE_RAY_ADDRESS"] = f"http://127.0.0.1:{free_port()}"
    env["QKSCOPE_RECONCILE_INTERVAL_S"] = "0.5"
    serve = Serve(env, tmp_path, "--port", str(api))
    try:
        serve.wait_for("qkscope API on", 60)
        study = httpx.post(f"{url}/v1/studies", json=tiny_study(), timeout=30).json()
        assert study["status"] == "PENDING" and study["ray_job_id"] is None
        assert study["waiting_reason"].startswith(RAY_UNREACHABLE), study
        assert env["QKSCOPE_RAY_ADDRESS"] in study["waiting_reason"]
        with Client(url) as qk:
            assert (qk.study(study["id"]).waiting_reason or "").startswith(RAY_UNREACHABLE)
            summary = qk.summary(study["id"])
            assert (summary.waiting_reason or "").startswith(RAY_UNREACHABLE)
            assert f"waiting: {RAY_UNREACHABLE}" in summary_line(summary)
        status = qkscope("status", str(study["id"]), env=env, cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["waiting_reason"].startswith(RAY_UNREACHABLE)
        submitted = qkscope("submit", str(ROOT / "study_defs" / "quickstart.yaml"), env=env,
                            cwd=tmp_path)  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        assert f"waiting: {RAY_UNREACHABLE}" in submitted.stdout
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        serve.proc.wait(timeout=30)
        serve.kill()


def test_unreachable_reason_is_cleared_and_runner_reasons_are_kept(db_url: str) -> None:
    sessions = make_sessionmaker(make_engine(db_url))
    from service.store import migrate

    migrate.upgrade(db_url)
    with session_scope(sessions) as s:
        rows = [
            Study(name=n, status=st, spec={}, n_trials=1, optuna_study_name=n, waiting_reason=w)
            for n, st, w in (
                ("pending", StudyStatus.PENDING, None),
                ("gpu", StudyStatus.RUNNING, "no alive node has gpus: 1"),
                ("done", StudyStatus.COMPLETED, None),
            )
        ]
        s.add_all(rows)
        s.flush()
        ids = [r.id for r in rows]
    assert (
        StudyRows(sessions).mark_ray_unreachable("http://ray:8265", "Connection refused\nmore") == 1
    )

    def reasons() -> list[str | None]:
        with session_scope(sessions) as s:
            return [s.get(Study, i).waiting_reason for i in ids]  # type: ignore[union-attr]

    pending, gpu, done = reasons()
    assert pending is not None and pending.startswith(RAY_UNREACHABLE)
    assert "http://ray:8265" in pending and "Connection refused" in pending
    assert "more" not in pending  # one line of the error
    assert gpu == "no alive node has gpus: 1" and done is None
    StudyRows(sessions).mark_ray_reachable()
    assert reasons() == [None, "no alive node has gpus: 1", None]


def test_a_job_server_that_never_answers_is_an_error_not_a_hang() -> None:
    """A port that accepts connections and never answers (a wedged dashboard): the job client
    gives up after its time limit instead of hanging `serve` or the reconciler for ever."""
    import socket
    import threading

    from service.control.ray_cluster import JobLauncher

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept_and_say_nothing, daemon=True)
    t.start()
    try:
        started = time.monotonic()
        with pytest.raises(Exception) as err:
            JobLauncher(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=1.0)
        assert time.monotonic() - started < 30, "the job client waited far past its limit"
        assert (
            "timed out" in str(err.value).lower() or "timeout" in type(err.value).__name__.lower()
        )
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        listener.close()
