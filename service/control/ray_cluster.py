"""The one place qkscope talks to Ray's control plane.

`LocalRayHead` starts and stops the embedded single-node cluster used by
`qkscope serve` (token auth on, dashboard on loopback). The head it starts is recorded in
`<home>/ray-head.json`, so a later `serve` can say it reuses a head left behind (after a
`kill -9`), and `qkscope stop` can end it: no orphaned Ray processes of qkscope's own.
`JobLauncher` submits, stops and lists study jobs through Ray's Job Submission API. Nothing here is
imported on the API's request path until a study is submitted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["JobLauncher", "LocalRayHead", "job_id_for", "pid_alive", "ray_token"]

HEAD_STATE = "ray-head.json"
IDLE_WORKERS_KEPT = 4  # worker processes a node keeps beyond its CPUs (standbys' warm ones)

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def job_id_for(study_id: int, attempt: int) -> str:
    """Ray job submission id: `qkscope-study-<id>-a<attempt>-<random>`.

    The prefix tells the dashboard's Jobs page which study it is; the suffix
    keeps ids unique when several qkscope databases share one Ray cluster.
    """
    return f"qkscope-study-{study_id}-a{attempt}-{secrets.token_hex(3)}"


def ray_token(home: Path) -> str:
    """RAY_AUTH_TOKEN from the environment, else a token kept in home (mode 0600)."""
    if tok := os.environ.get("RAY_AUTH_TOKEN"):
        return tok
    path = home / "ray_auth_token"
    if path.exists():
        return path.read_text().strip()
    home.mkdir(parents=True, exist_ok=True)
    tok = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tok)
    return tok


def pid_alive(pid: int, cmd_has: str = "") -> bool:
    """True when `pid` runs (and, where /proc tells, its command line contains `cmd_has`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie has exited
            return False
        return cmd_has in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


@dataclass
class LocalRayHead:
    """A single-node Ray cluster in a child process (`ray start --head --block`)."""

    home: Path
    gcs_port: int = 6390  # not 6379: that is Redis's port on most machines
    dashboard_port: int = 8265
    num_cpus: int | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _adopted_pid: int | None = None  # a head an earlier `serve` started and left running

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def state_path(self) -> Path:
        return self.home / HEAD_STATE

    @property
    def pid(self) -> int | None:
        """The `ray start --block` process (the leader of the head's process group)."""
        return self._proc.pid if self._proc is not None else self._adopted_pid

    def alive(self) -> bool:
        """True while the head's `ray start --block` runs and its GCS and dashboard (the job
        server) accept connections: `ray start --block` outlives a killed GCS."""
        if self._proc is not None:
            running = self._proc.poll() is None
        else:
            running = self._adopted_pid is not None and pid_alive(self._adopted_pid, "ray")
        return running and all(_listening(p) for p in (self.gcs_port, self.dashboard_port))

    def restart(self, timeout_s: float = 120.0) -> str:
        """Clear what is left of a dead head (its process group) and start a new one on the
        same ports; returns the dashboard URL. No graceful stop: with its GCS gone, `ray
        start --block` spends ~35 s trying to tear down through it before it exits."""
        self.stop(grace_s=2.0)
        return self.start(timeout_s)

    def recorded(self) -> dict[str, Any] | None:
        """The head recorded in home if its process still runs; a stale record is removed."""
        try:
            state = dict(json.loads(self.state_path.read_text()))
        except (OSError, ValueError):
            return None
        if pid_alive(int(state.get("pid", 0)), "ray"):
            return state
        self.state_path.unlink(missing_ok=True)
        return None

    def adopt(self, timeout_s: float = 30.0) -> bool:
        """Reuse the head an earlier `serve` from this home left running (after a kill -9):
        True when it answers on its dashboard; a recorded head that does not is stopped."""
        state = self.recorded()
        if state is None:
            return False
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = ray_token(self.home)
        self._adopted_pid = int(state["pid"])
        self.gcs_port = int(state["gcs_port"])
        self.dashboard_port = int(state["dashboard_port"])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                JobLauncher(self.dashboard_url).list_jobs()
            except Exception:
                time.sleep(1.0)
                continue
            # Its `serve` is gone (the caller holds the home's serve lock): this one owns it.
            state["serve_pid"] = os.getpid()
            self.state_path.write_text(json.dumps(state))
            return True
        self.stop()
        return False

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the head with token auth; returns the dashboard URL once jobs are accepted."""
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = ray_token(self.home)
        env = dict(os.environ)
        # The job entrypoint runs `python -m service.runner`: make that this interpreter.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        # Ray kills idle worker processes once a node has more than its CPUs' worth: while a
        # study trains on every core, a standby's warm workers would go, torch with them
        # (service/runner/standby.py). Room for a few more keeps them (memory, not CPU).
        cpus = self.num_cpus or os.cpu_count() or 1
        env.setdefault("RAY_num_workers_soft_limit", str(cpus + IDLE_WORKERS_KEPT))
        ray_bin = shutil.which("ray", path=env["PATH"]) or "ray"
        cmd = [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={self.gcs_port}",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            "--include-dashboard=true",
            # Not Ray's fixed default (52365): two clusters on one machine must not collide.
            f"--dashboard-agent-listen-port={_free_port()}",
            "--disable-usage-stats",
        ]
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        logdir = self.home / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        cwd = self.home / "ray-cwd"
        cwd.mkdir(parents=True, exist_ok=True)
        with open(logdir / "ray-head.log", "ab") as out:
            self._proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.state_path.write_text(
            json.dumps(
                {
                    "pid": self._proc.pid,
                    "gcs_port": self.gcs_port,
                    "dashboard_port": self.dashboard_port,
                    "started_at": time.time(),
                    "serve_pid": os.getpid(),  # the process that owns (and stops) it
                }
            )
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"ray head exited early; see {logdir / 'ray-head.log'}")
            try:
                JobLauncher(self.dashboard_url).list_jobs()
                return self.dashboard_url
            except Exception:
                time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"ray head not ready after {timeout_s}s")

    def stop(self, grace_s: float = 60.0) -> None:
        """Stop the head this object started or adopted (SIGTERM: `ray start --block` tears
        the whole node down; its process group is killed if it has not after `grace_s`)."""
        proc, self._proc = self._proc, None
        pid, self._adopted_pid = (proc.pid if proc else self._adopted_pid), None
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if (proc.poll() is not None) if proc is not None else not pid_alive(pid):
                break
            time.sleep(0.2)
        # Whatever of the node is left in the head's process group (all of it on timeout).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if proc is not None:
            proc.wait()
        self.state_path.unlink(missing_ok=True)


JOB_SERVER_TIMEOUT_S = 30.0  # one request to Ray's job server, the connection check included


def _job_client(address: str, timeout_s: float) -> Any:
    """Ray's job client with a time limit on every request: its own requests have none, so a
    port that accepts connections and never answers (a wedged or half-started dashboard)
    would hang `serve`, a head restart and the API's reconciler for ever. Ray is pinned
    (pyproject.toml), and `_do_request` is where all of its requests go."""
    from ray.job_submission import JobSubmissionClient

    class _TimedClient(JobSubmissionClient):  # type: ignore[misc]
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return _TimedClient(address)


class JobLauncher:
    """Ray Job Submission API for study jobs (the Ray token comes from the environment)."""

    def __init__(self, address: str, timeout_s: float = JOB_SERVER_TIMEOUT_S) -> None:
        self.address = address
        self._client = _job_client(address, timeout_s)

    def submit_study(
        self, study_id: int, attempt: int, env: dict[str, str], job_id: str | None = None
    ) -> str:
        """Submit the runner job of one attempt, under `job_id` (chosen by the caller, who
        records it first) or a new one."""
        job_id = job_id or job_id_for(study_id, attempt)
        self._client.submit_job(
            entrypoint=f"python -m service.runner {study_id} {attempt}",
            submission_id=job_id,
            runtime_env={"env_vars": env},
            metadata={"qkscope_study": str(study_id), "attempt": str(attempt)},
            entrypoint_num_cpus=0,
        )
        return job_id

    def stop(self, job_id: str) -> bool:
        try:
            return bool(self._client.stop_job(job_id))
        except Exception as e:  # an unknown or finished job is not an error for cancel
            log.warning("stop_job(%s): %s", job_id, e)
            return False

    def status(self, job_id: str) -> str | None:
        """Ray's JobStatus name, or None when Ray does not know the job."""
        try:
            return str(self._client.get_job_status(job_id).value)
        except Exception:
            return None

    def node_resources(self) -> list[dict[str, float]] | None:
        """Total resources of each alive node (Ray's state API), or None if Ray can't say."""
        try:
            from ray.util.state import list_nodes

            nodes = list_nodes(address=self.address, filters=[("state", "=", "ALIVE")], timeout=10)
            out = [{k: float(v) for k, v in (n.resources_total or {}).items()} for n in nodes]
        except Exception as e:
            log.warning("node resources unavailable: %s", e)
            return None
        return out or None

    def lookup(self, job_id: str) -> str | None:
        """Ask Ray for one job by its submission id: its JobStatus name, or None when Ray
        answers that it has no such job (HTTP 404).

        Raises:
            Exception: Ray did not answer (a connection error, a timeout, another status):
                whether it has the job is unknown.
        """
        r = self._client._do_request("GET", f"/api/jobs/{job_id}")
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RuntimeError(f"job server answered {r.status_code} for {job_id}: {r.text}")
        return str(r.json()["status"])

    def list_jobs(self) -> list[Any]:
        return list(self._client.list_jobs())

    def logs(self, job_id: str) -> str:
        return str(self._client.get_job_logs(job_id))
