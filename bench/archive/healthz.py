"""`/healthz` latency under a storm of POSTs and reads, today's code against a baseline commit.

Issue 32, item 3: `POST /v1/studies` submitted the Ray job on the API's event loop, so every
request, `/healthz` included, waited for the submit (4.5 s for a 5 s submit; the compose
healthcheck gives up at 3 s). This runs the same storm against two API processes, one on
today's tree and one on commit REF (checked out in a temporary git worktree, put first on
PYTHONPATH), one after the other, each with:

- Ray's job server played by a slow HTTP server on loopback: the version check at once,
  each job submission after `--submit-s` (what a busy or restarting head does);
- `--posters` threads POSTing study definitions and `--readers` threads reading
  (`GET /v1/studies`, `GET /v1/studies/{id}`) as fast as they get answers, for `--seconds`
  (at most `--max-posts` POSTs in all);
- one prober asking `/healthz` every 50 ms and timing each answer.

Printed per tree: `/healthz` p50 / p99 / max and how many probes, POSTs and reads were
answered; then the ratio of REF to today (above 1: today answers faster). SQLite, loopback
only, free ports only.

    .venv/bin/python -m bench.archive.healthz [--ref b77e7fc] [--seconds 20] [--submit-s 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench._common import busy_note, free_port, load1, machine_line, percentile, say, table

ROOT = Path(__file__).resolve().parents[1]
STUDY = {"name": "storm", "budget": {"n_trials": 2}, "base": {"steps": 20, "eval_every": 10}}


class SlowJobServer:
    """Ray's job server, slow to take a submission (loopback, a free port)."""

    def __init__(self, submit_s: float) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:
                pass

            def _json(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.startswith("/api/version"):
                    self._json(200, {"version": "4", "ray_version": "2.60.0", "ray_commit": "x"})
                elif self.path.startswith("/api/jobs"):
                    self._json(200, [])
                else:
                    self._json(404, {})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n) or b"{}")
                time.sleep(submit_s)
                sid = body.get("submission_id", "")
                self._json(200, {"submission_id": sid, "job_id": None})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _request(url: str, data: bytes | None = None) -> bytes:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return bytes(r.read())


def _serve(tree: Path, work: Path, ray_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """The API of `tree` under uvicorn on a free port (its own SQLite file and home)."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "QKSCOPE_HOME": str(work / "home"),
        "QKSCOPE_DATABASE_URL": f"sqlite:///{work / 'q.db'}",
        "QKSCOPE_RAY_ADDRESS": ray_url,
        "QKSCOPE_API_TOKENS": "",
        "QKSCOPE_CHECK_RESOURCES": "false",
        "QKSCOPE_RECONCILE_INTERVAL_S": "3600",  # one round at start: the storm is the load
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _request(f"{url}/healthz")
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the API of {tree} did not start") from None
            time.sleep(0.2)


def storm(url: str, seconds: float, posters: int, readers: int, max_posts: int) -> dict[str, Any]:
    """The storm against one API; `/healthz` latencies and the counts answered."""
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    counts = {"posts": 0, "reads": 0, "errors": 0}
    ids: list[int] = []
    health: list[float] = []
    body = json.dumps(STUDY).encode()

    def poster() -> None:
        while time.monotonic() < stop:
            with lock:
                if counts["posts"] >= max_posts:
                    return
                counts["posts"] += 1
            try:
                ids.append(int(json.loads(_request(f"{url}/v1/studies", body))["id"]))
            except OSError:
                with lock:
                    counts["errors"] += 1

    def reader() -> None:
        while time.monotonic() < stop:
            try:
                _request(f"{url}/v1/studies?limit=20")
                if ids:
                    _request(f"{url}/v1/studies/{ids[-1]}")
                with lock:
                    counts["reads"] += 1
            except OSError:
                with lock:
                    counts["errors"] += 1

    def prober() -> None:
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                _request(f"{url}/healthz")
                health.append(time.perf_counter() - t0)
            except OSError:
                with lock:
                    counts["errors"] += 1
            time.sleep(0.05)

    threads = [threading.Thread(target=poster) for _ in range(posters)]
    threads += [threading.Thread(target=reader) for _ in range(readers)]
    threads.append(threading.Thread(target=prober))
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 180)
    return {"health": health, **counts, "answered_posts": len(ids)}


def _worktree(tmp: str, ref: str) -> Path:
    tree = Path(tmp) / f"ref-{ref}"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), ref],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    return tree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", default="b77e7fc", help="the baseline commit (before issue 32)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--submit-s", type=float, default=2.0, help="how long each submit takes")
    p.add_argument("--posters", type=int, default=4)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--max-posts", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="8 s storms")
    args = p.parse_args(argv)
    seconds = 8.0 if args.quick else args.seconds
    load_before = load1()
    say(machine_line())
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="qkscope-healthz-") as tmp:
        ref = _worktree(tmp, args.ref)
        try:
            for name, tree in (("today", ROOT), (args.ref, ref)):
                work = Path(tmp) / f"work-{name}"
                work.mkdir()
                jobs = SlowJobServer(args.submit_s)
                proc, url = _serve(tree, work, jobs.url)
                try:
                    say(f"{name}: {seconds:.0f} s storm, submits take {args.submit_s} s")
                    results[name] = storm(url, seconds, args.posters, args.readers, args.max_posts)
                finally:
                    proc.terminate()
                    proc.wait(30)
                    jobs.close()
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(ref)], cwd=ROOT, capture_output=True
            )
    rows = []
    for name, r in results.items():
        h = r["health"]
        rows.append(
            [
                name,
                len(h),
                1000 * percentile(h, 50),
                1000 * percentile(h, 99),
                1000 * max(h, default=float("nan")),
                r["answered_posts"],
                r["reads"],
                r["errors"],
            ]
        )
    header = ["code", "probes", "p50 ms", "p99 ms", "max ms", "POSTs", "reads", "errors"]
    title = (
        f"/healthz under {args.posters} posters and {args.readers} readers for {seconds:.0f} s,"
        f" each Ray submit {args.submit_s} s"
    )
    print(table(header, rows, title))
    now, old = results["today"]["health"], results[args.ref]["health"]
    ratios = [
        ["p50", percentile(old, 50) / percentile(now, 50)],
        ["p99", percentile(old, 99) / percentile(now, 99)],
    ]
    print(table(["figure", f"{args.ref} / today"], ratios, "ratio (above 1: today is faster)"))
    if note := busy_note(load_before):
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
