"""Load test (issue #4): 50 concurrent clients reading results while a study runs.

`qkscope serve` runs as a subprocess on loopback with API tokens configured
(QKSCOPE_API_TOKENS) on a Ray head of its own, with a study running (2 trials in flight,
their metrics streaming into the database). Then `--clients` concurrent clients (one
httpx.AsyncClient each, bearer token) loop for `--duration` seconds over the results
routes a dashboard polls: GET /v1/studies/{id}, /v1/studies/{id}/trials, /summary and one
trial's /metrics. Reported: requests/s, p50/p99 latency per route and overall, and errors
(any non-2xx or transport error; the goal is zero).

Baseline, same run, same clients: GET /healthz (no token, no database) mixed into the
same request stream (one request in five), so its latency is measured under the same
conditions; "results p50 / healthz p50" says what the database work adds to the server's
and this machine's floor.

Everything stays on 127.0.0.1 and stops by itself after `--duration` seconds.

    python -m bench.load                     # SQLite and PostgreSQL, 30 s each
    python -m bench.load --quick             # SQLite, 10 s, 20 clients
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import (
    busy_note,
    load1,
    machine_line,
    percentile,
    pg_available,
    pg_database,
    say,
    table,
)
from bench.orchestration import start_serve, stop_serve

BASELINE = "GET /healthz (baseline: no token, no database)"
ALL = "all results routes"

STUDY: dict[str, Any] = {
    "name": "bench-load",
    "base": {
        "task": {"kind": "associative_recall", "seq_len": 24, "n_symbols": 16, "n_pairs": 6},
        "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64},
        "regularizer": {"kind": "locater"},
        "steps": 400,
        "eval_every": 25,
    },
    "search_space": {
        "regularizer.lambda": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
        "model.qk_init_std": {"type": "float", "low": 0.02, "high": 1.5, "log": True},
    },
    "sampler": {"kind": "tpe", "seed": 0, "n_startup_trials": 4},
    "budget": {"n_trials": 1000},
    "parallelism": 2,
    "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
    "constraints": [{"metric": "min_norm_entropy", "op": ">=", "value": 0.1}],
}


async def client_loop(
    api: str,
    token: str | None,
    routes: list[tuple[str, str, dict[str, Any]]],
    deadline: float,
    start_at: int,
    log: list[tuple[str, float, bool]],
) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=api, headers=headers, timeout=30) as c:
        for i in itertools.count(start_at):
            if time.perf_counter() >= deadline:
                return
            name, path, params = routes[i % len(routes)]
            t0 = time.perf_counter()
            ok = False
            try:
                r = await c.get(path, params=params)
                await r.aread()
                ok = r.status_code < 400
            except httpx.HTTPError:
                ok = False
            log.append((name, (time.perf_counter() - t0) * 1000, ok))


async def hammer(
    api: str,
    token: str | None,
    routes: list[tuple[str, str, dict[str, Any]]],
    clients: int,
    duration: float,
) -> tuple[list[tuple[str, float, bool]], float]:
    log: list[tuple[str, float, bool]] = []
    t0 = time.perf_counter()
    deadline = t0 + duration
    await asyncio.gather(
        *(client_loop(api, token, routes, deadline, i, log) for i in range(clients))
    )
    return log, time.perf_counter() - t0


def summarize(label: str, log: list[tuple[str, float, bool]], wall: float) -> list[list[Any]]:
    rows = []
    names = list(dict.fromkeys(n for n, _, _ in log))
    for name in [*[n for n in names if n != BASELINE], ALL, BASELINE]:
        sel = [(ms, ok) for n, ms, ok in log if n == name or (name == ALL and n != BASELINE)]
        lat = [ms for ms, _ in sel]
        rows.append(
            [label, name, len(sel), len(sel) / wall, percentile(lat, 50), percentile(lat, 99),
             sum(1 for _, ok in sel if not ok)]
        )  # fmt: skip
    return rows


def run_one(db: str, url: str | None, args: argparse.Namespace, work: Path) -> list[list[Any]]:
    token = f"bench-{secrets.token_hex(16)}"
    extra = {"QKSCOPE_API_TOKENS": token}
    if url:
        extra["QKSCOPE_DATABASE_URL"] = url
    head, proc, api, startup = start_serve(work, 2, extra)
    say(f"  {db}: service up in {startup:.0f} s; submitting a study")
    headers = {"Authorization": f"Bearer {token}"}
    try:
        with httpx.Client(base_url=api, headers=headers, timeout=60) as c:
            assert c.get("/v1/studies").status_code == 200
            assert httpx.get(f"{api}/v1/studies", timeout=30).status_code == 401  # tokens on
            sid = c.post("/v1/studies", json=STUDY).raise_for_status().json()["id"]
            t0 = time.perf_counter()
            trial_ids: list[int] = []
            while time.perf_counter() - t0 < 300:  # until a trial has reported metrics
                items = c.get(f"/v1/studies/{sid}/trials", params={"limit": 10}).json()["items"]
                trial_ids = [t["id"] for t in items if t["last_step"] > 0]
                if trial_ids:
                    break
                time.sleep(1.0)
            if not trial_ids:
                raise RuntimeError(
                    f"no trial reported within 300 s: {c.get(f'/v1/studies/{sid}').json()}"
                )
        say(f"  {db}: study {sid} running; {args.clients} clients for {args.duration:.0f} s")
        routes = [
            ("GET /studies/{id}", f"/v1/studies/{sid}", {}),
            ("GET /studies/{id}/trials", f"/v1/studies/{sid}/trials", {"limit": 50, "sort": "-number"}),
            ("GET /studies/{id}/summary", f"/v1/studies/{sid}/summary", {}),
            ("GET /trials/{id}/metrics", f"/v1/trials/{trial_ids[0]}/metrics",
             {"name": "attn_entropy_norm"}),
            (BASELINE, "/healthz", {}),
        ]  # fmt: skip
        log, wall = asyncio.run(hammer(api, token, routes, args.clients, args.duration))
        with httpx.Client(base_url=api, headers=headers, timeout=60) as c:
            study = c.get(f"/v1/studies/{sid}").json()
            summary = c.get(f"/v1/studies/{sid}/summary").json()
            c.post(f"/v1/studies/{sid}/cancel")
        if study["status"] != "RUNNING":
            raise RuntimeError(
                f"the study stopped during the load: {study['status']} {study['error']}"
            )
        say(f"  {db}: study still RUNNING after the load, {summary['finished']} trials finished")
    finally:
        stop_serve(head, proc)
    return summarize(db, log, wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="SQLite only, 10 s, 20 clients")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default 50)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default 30)")
    p.add_argument("--db", default=None, help="comma-separated: sqlite,postgresql")
    args = p.parse_args(argv)
    args.clients = args.clients or (20 if args.quick else 50)
    args.duration = args.duration or (10.0 if args.quick else 30.0)
    args.db = args.db or ("sqlite" if args.quick else "sqlite,postgresql")
    load0 = load1()
    t_start = time.perf_counter()
    rows: list[list[Any]] = []
    notes: list[str] = []
    for db in [d.strip() for d in args.db.split(",") if d.strip()]:
        with tempfile.TemporaryDirectory(prefix=f"qkscope-bench-load-{db}-") as tmp:
            say(f"load: {db}, {args.clients} clients x {args.duration:.0f} s")
            if db == "postgresql":
                if problem := pg_available():
                    notes.append(f"PostgreSQL skipped: {problem}")
                    continue
                with pg_database("qkscope_bench_load") as url:
                    rows += run_one("PostgreSQL", url, args, Path(tmp))
            else:
                rows += run_one("SQLite", None, args, Path(tmp))
    print(f"load: {machine_line()}")
    print(
        f"{args.clients} concurrent clients (httpx async, keep-alive, bearer token) for "
        f"{args.duration:.0f} s against `qkscope serve` on 127.0.0.1 (uvicorn, 1 process) while "
        "a study runs 2 trials at a time on the same 2 cores; baseline = /healthz in the same stream"
    )
    print(table(["database", "route", "requests", "req/s", "p50 ms", "p99 ms", "errors"], rows))
    errors = sum(r[6] for r in rows if r[1] == ALL)
    for db in dict.fromkeys(r[0] for r in rows):
        base = next(r for r in rows if r[0] == db and r[1] == BASELINE)
        allr = next(r for r in rows if r[0] == db and r[1] == ALL)
        print(
            f"{db}: results routes {allr[3]:,.0f} req/s, p50 {allr[4]:.0f} ms = "
            f"{allr[4] / base[4]:.2f} x the /healthz p50 measured in the same stream"
        )
    print(f"goal: zero errors: {'met' if errors == 0 else 'NOT met'} ({errors} errors)")
    for n in notes:
        print(f"note: {n}")
    if w := busy_note(load0):
        print(w)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
