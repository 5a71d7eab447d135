"""Helpers shared by the benchmarks: tables, machine notes, throwaway databases, ports."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

PG_ADMIN_URL = os.environ.get(
    "QKSCOPE_BENCH_PG_URL",
    os.environ.get("QKSCOPE_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"),
)


def load1() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def machine_line() -> str:
    """One line of context: CPUs, load, GPU, library versions."""
    parts = [
        f"cpus={os.cpu_count()}",
        f"load1={load1():.1f}",
        f"python={platform.python_version()}",
    ]
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        parts += [f"torch={torch.__version__}", f"gpu={gpu}"]
    except ImportError:
        pass
    for mod in ("ray", "optuna", "sqlalchemy"):
        with contextlib.suppress(ImportError):
            parts.append(f"{mod}={__import__(mod).__version__}")
    return " ".join(parts)


def busy_note(load_before: float) -> str | None:
    cpus = os.cpu_count() or 1
    worst = max(load_before, load1())
    if worst > 0.75 * cpus:
        return (
            f"warning: machine busy (1-min load up to {worst:.1f} on {cpus} CPUs): other "
            "processes distort these timings; the ratios are the numbers to compare"
        )
    return None


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.{digits}g}"
    return str(v)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A Markdown table (what bench/README.md shows), numbers right-aligned."""
    cells = [[fmt(c) for c in r] for r in rows]
    numeric = [
        all(isinstance(r[i], int | float) or r[i] is None for r in rows) and bool(rows)
        for i in range(len(header))
    ]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]

    def line(vals: Sequence[str]) -> str:
        out = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(vals, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(out) + " |"

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if n else "-" * (w + 2)
            for w, n in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    lines = ([f"\n### {title}\n"] if title else []) + [line(header), sep] + [line(r) for r in cells]
    return "\n".join(lines)


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not xs:
        return float("nan")
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return float(ys[lo] + (ys[hi] - ys[lo]) * (pos - lo))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pg_available() -> str | None:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3):
            return None
    except Exception as e:  # noqa: BLE001 - any failure means "no server"
        return str(e)


@contextlib.contextmanager
def pg_database(prefix: str = "qkscope_bench") -> Iterator[str]:
    """A throwaway PostgreSQL database (dropped afterwards); yields its URL."""
    import psycopg

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def say(*args: Any) -> None:
    """Progress lines go to stderr; the tables go to stdout."""
    print(*args, file=sys.stderr, flush=True)


class RayHead:
    """A local Ray head (`ray start --head --block`, token auth on) on free ports only.

    Like service.control.ray_cluster.LocalRayHead, but every port a second head on the same
    machine could collide with is chosen free, including the dashboard agent's (52365 by
    default: a second head that loses that port cannot accept jobs). Used with
    QKSCOPE_RAY_ADDRESS so `qkscope serve` connects to it instead of starting its own.
    """

    def __init__(self, home: Any, num_cpus: int) -> None:
        import secrets
        from pathlib import Path

        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.num_cpus = num_cpus
        self.token = secrets.token_hex(32)
        self.dashboard_port = free_port()
        self.proc: Any = None
        # A Ray temp dir of its own: under the shared default (/tmp/ray) another head's `ray
        # start` rewrites ray_current_cluster, and this head's job supervisor then points its
        # jobs' drivers at that other cluster (a runner hung on a foreign GCS). Short, because
        # Ray puts unix sockets under it.
        import tempfile

        self.temp_dir = tempfile.mkdtemp(prefix="rq", dir="/tmp")

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def start(self, timeout_s: float = 180.0) -> float:
        """Start it; returns the seconds until it accepted job API calls."""
        import shutil
        import subprocess
        from pathlib import Path

        from service.control.ray_cluster import IDLE_WORKERS_KEPT

        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(self.env())
        # as the head `qkscope serve` starts (service/control/ray_cluster.py)
        env["RAY_num_workers_soft_limit"] = str(self.num_cpus + IDLE_WORKERS_KEPT)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        ray_bin = shutil.which("ray", path=env["PATH"]) or "ray"
        cmd = [
            ray_bin, "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
            f"--port={free_port()}", f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--num-cpus={self.num_cpus}", "--include-dashboard=true",
            f"--temp-dir={self.temp_dir}",
        ]  # fmt: skip
        cwd = self.home / "ray-cwd"
        cwd.mkdir(exist_ok=True)
        self._log = open(self.home / "ray-head.log", "wb")  # noqa: SIM115 - closed in stop()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"}
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited; see {self.home / 'ray-head.log'}")
            try:
                r = httpx.get(f"{self.address}/api/jobs/", headers=headers, timeout=5)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # Job submission needs the node's dashboard agent, which comes up later than the
        # job API: a no-op job that succeeds proves the head accepts real jobs.
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited; see {self.home / 'ray-head.log'}")
            try:
                r = httpx.post(
                    f"{self.address}/api/jobs/",
                    headers=headers,
                    json={"entrypoint": "true", "entrypoint_num_cpus": 0},
                    timeout=10,
                )
                if r.status_code == 200:
                    job = r.json()["submission_id"]
                    while time.perf_counter() - t0 < timeout_s:
                        st = httpx.get(
                            f"{self.address}/api/jobs/{job}", headers=headers, timeout=10
                        ).json()["status"]
                        if st == "SUCCEEDED":
                            return time.perf_counter() - t0
                        if st in ("FAILED", "STOPPED"):
                            break
                        time.sleep(0.3)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"ray head not ready after {timeout_s} s")

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self._log.close()
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)


def standby_ready(c: Any, timeout_s: float = 120.0) -> float:
    """Wait until the service (an httpx client on its API) shows a ready standby runner
    (`/metrics`); returns the wait."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        for line in c.get("/metrics").text.splitlines():
            ready = line.startswith('qkscope_standby_runners{state="ready"}')
            if ready and float(line.split()[-1]) >= 1:
                return time.time() - t0
        time.sleep(0.2)
    raise TimeoutError(f"no standby runner ready after {timeout_s} s")
