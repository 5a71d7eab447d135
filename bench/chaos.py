"""Chaos: one fused study on PostgreSQL through everything that fails, against the same
study undisturbed.

    .venv/bin/python -m bench.chaos [--trials 12] [--steps 320] [--cut 20] [--window 120]

A local Ray head (token auth), the API as its own process (uvicorn, reconciler every
second), PostgreSQL behind a TCP proxy that can cut it off (tests/service/db_proxy.py).
The same study (`fuse: 2`, random sampler, seeded) runs twice: undisturbed, then with, each
once and in this order while it runs: a slot worker SIGKILLed, the runner (the Ray job's
driver) SIGKILLed, the API process restarted, and the database cut for `--cut` seconds
(inside QKSCOPE_DB_OUTAGE_S, `--window`, 120 s by default). Printed: trials lost (planned
but not ended with a result), duplicated (a trial number or a metric row twice), run twice (a trial that had
ended and was changed afterwards), all of which must be 0; the invariants of
tests/service/invariants.py; and the wall time of both runs side by side.
Not a test (timings), not part of `python -m bench`.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import (
    RayHead,
    busy_note,
    free_port,
    load1,
    machine_line,
    pg_database,
    say,
    table,
)

TOKEN = "chaos-bench-token"


def _spec(n_trials: int, steps: int) -> dict[str, Any]:
    from tests.service.invariants import fault_spec

    spec = fault_spec(n_trials=n_trials, steps=steps)
    spec.update(fuse=2, name="chaos")
    return spec


class Api:
    """`uvicorn service.app:create_app --factory` in a child process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.port = env, free_port()
        self.proc: Any = None
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
        )

    def start(self) -> None:
        import subprocess
        import sys

        cmd = [
            sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=self.env)
        _until("API up", self._healthy, 120)

    def _healthy(self) -> bool:
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str) -> Any:
        """A GET that waits out a 503 (database away) or an API restarting."""
        deadline = time.monotonic() + 300
        while True:
            try:
                r = self.http.get(path)
                if r.status_code == 200:
                    return r.json()
                if r.status_code != 503:
                    raise RuntimeError(f"GET {path}: {r.status_code} {r.text[:300]}")
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"GET {path}")
            time.sleep(0.5)


def _until(what: str, cond: Any, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := cond():
            return out
        time.sleep(0.3)
    raise TimeoutError(what)


def _trials(api: Api, sid: int) -> list[dict[str, Any]]:
    return list(api.get(f"/v1/studies/{sid}/trials?limit=1000")["items"])


def _ended(trials: list[dict[str, Any]]) -> dict[int, tuple[Any, ...]]:
    """What each trial that ended with a result recorded (changed later = run twice)."""
    return {
        t["number"]: (t["finished_at"], t["value"], t["state"])
        for t in trials
        if t["state"] in ("COMPLETE", "PRUNED", "DIVERGED")
    }


def _running(trials: list[dict[str, Any]], steps: int) -> bool:
    return any(t["state"] == "RUNNING" and 0 < t["last_step"] < steps * 3 // 4 for t in trials)


def _progress(
    api: Api, sid: int, done: int, spec: dict[str, Any], training: bool
) -> list[dict[str, Any]] | None:
    """The trials, once more than `done` ended and (with `training`) one is training, not
    near its end (a worker or runner killed then has something to lose)."""
    trials = _trials(api, sid)
    ok = len(_ended(trials)) > done and (not training or _running(trials, spec["base"]["steps"]))
    return trials if ok else None


def _worker_pid(dashboard: str, sid: int) -> int | None:
    from ray.util.state import list_tasks

    tasks = list_tasks(address=dashboard, filters=[("state", "=", "RUNNING")], detail=True)
    pids = [
        t.worker_pid
        for t in tasks
        if (t.name or "").startswith(f"study-{sid}/worker-") and t.worker_pid
    ]
    return int(pids[0]) if pids else None


def run_study(api: Api, spec: dict[str, Any], faults: list[tuple[str, Any]]) -> dict[str, Any]:
    """POST the study, apply `faults` (name, action) one by one while it runs (each after
    one more trial ended and another is training), wait for its end."""
    t0 = time.perf_counter()
    r = api.http.post("/v1/studies", json=spec)
    assert r.status_code == 201, r.text
    sid = int(r.json()["id"])
    snapshots: list[dict[int, tuple[Any, ...]]] = []
    done_before = 0
    for name, action in faults:
        training = name.startswith("kill")
        seen = _until(
            f"progress before {name}",
            lambda d=done_before, t=training: _progress(api, sid, d, spec, t),
        )
        snapshots.append(_ended(seen))
        done_before = len(snapshots[-1])
        say(f"study {sid}: {name} ({done_before} trials ended so far)")
        action(sid)
    study = _until(
        "study end",
        lambda: (s if (s := api.get(f"/v1/studies/{sid}"))["status"] != "RUNNING"
                 and s["status"] != "PENDING" else None),
        timeout=1800,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    trials = _trials(api, sid)
    after = _ended(trials)
    run_twice = sum(
        1 for snap in snapshots for n, rec in snap.items() if after.get(n) != rec
    ) if snapshots else 0  # fmt: skip
    return {"sid": sid, "study": study, "wall": wall, "trials": trials, "run_twice": run_twice}


def _counts(db_url: str, sid: int, n_trials: int) -> dict[str, Any]:
    from sqlalchemy import text

    from service.store import make_engine
    from tests.service.invariants import check_finished_study

    engine = make_engine(db_url)
    try:
        with engine.connect() as c:
            numbers = [
                int(n)
                for (n,) in c.execute(
                    text("SELECT number FROM qk_trial WHERE study_id = :s"), {"s": sid}
                )
            ]
            ended = c.execute(
                text(
                    "SELECT count(*) FROM qk_trial WHERE study_id = :s "
                    "AND state IN ('COMPLETE', 'PRUNED', 'DIVERGED')"
                ),
                {"s": sid},
            ).scalar_one()
            dup_rows = c.execute(
                text(
                    "SELECT count(*) FROM (SELECT 1 FROM qk_metric m JOIN qk_trial t "
                    "ON t.id = m.trial_id WHERE t.study_id = :s "
                    "GROUP BY m.trial_id, m.name, m.layer, m.head, m.step "
                    "HAVING count(*) > 1) d"
                ),
                {"s": sid},
            ).scalar_one()
            attempts = c.execute(
                text("SELECT coalesce(sum(attempts - 1), 0) FROM qk_trial WHERE study_id = :s"),
                {"s": sid},
            ).scalar_one()
            jobs = c.execute(
                text("SELECT job_attempts FROM qk_study WHERE id = :s"), {"s": sid}
            ).scalar_one()
    finally:
        engine.dispose()
    try:
        check_finished_study(db_url, sid)
        invariants = "hold"
    except AssertionError as e:
        invariants = f"VIOLATED: {str(e)[:200]}"
    return {
        "lost": n_trials - int(ended),
        "duplicated": (len(numbers) - len(set(numbers))) + int(dup_rows),
        "resumed": int(attempts),
        "jobs": int(jobs),
        "invariants": invariants,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--cut", type=float, default=20.0, help="seconds the database is cut off")
    p.add_argument(
        "--window", type=float, default=120.0, help="QKSCOPE_DB_OUTAGE_S for the runners"
    )
    args = p.parse_args(argv)
    load_before = load1()
    with tempfile.TemporaryDirectory(prefix="qkchaos-") as tmp, pg_database("qk_chaos") as db:
        home = Path(tmp)
        head = RayHead(home / "ray", num_cpus=2)
        os.environ.update(head.env())  # before anything imports ray
        from service.store import upgrade_schema
        from tests.service.db_proxy import CuttableProxy

        upgrade_schema(db)
        proxy = CuttableProxy(db)
        say(f"ray head ready in {head.start():.0f} s")
        env = {k: v for k, v in os.environ.items() if not k.startswith("QKSCOPE_")}
        env |= {
            "QKSCOPE_DATABASE_URL": proxy.url,
            "QKSCOPE_RAY_ADDRESS": head.address,
            "QKSCOPE_HOME": str(home / "home"),
            "QKSCOPE_CHECKPOINT_DIR": str(home / "ckpt"),
            "QKSCOPE_RECONCILE_INTERVAL_S": "1",
            "QKSCOPE_DB_OUTAGE_S": f"{args.window:g}",
            "QKSCOPE_API_TOKENS": TOKEN,
        }
        api = Api(env)
        api.start()
        try:
            spec = _spec(args.trials, args.steps)
            say("undisturbed run ...")
            calm = run_study(api, {**spec, "name": "calm"}, [])

            from tests.service.test_restarts import kill_runner

            class _Head:  # what kill_runner needs of a head
                dashboard_url = head.address

            def kill_worker(sid: int) -> None:
                pid = _until("a slot worker", lambda: _worker_pid(head.address, sid), 120)
                os.kill(pid, signal.SIGKILL)

            def kill_the_runner(sid: int) -> None:
                job = api.get(f"/v1/studies/{sid}")["ray_job_id"]
                kill_runner(_Head(), job)  # type: ignore[arg-type]

            def restart_api(_sid: int) -> None:
                api.stop()
                api.start()

            def cut_db(_sid: int) -> None:
                proxy.cut_for(args.cut).join()

            say("chaos run ...")
            chaos = run_study(
                api,
                {**spec, "name": "chaos"},
                [
                    ("kill a slot worker", kill_worker),
                    ("kill the runner", kill_the_runner),
                    ("restart the API", restart_api),
                    (f"cut the database for {args.cut:.0f} s", cut_db),
                ],
            )
        finally:
            api.stop()
            proxy.close()
            head.stop()
        rows = []
        for name, run in (("undisturbed", calm), ("chaos", chaos)):
            c = _counts(db, run["sid"], args.trials)
            rows.append(
                [
                    name,
                    run["study"]["status"],
                    c["lost"],
                    c["duplicated"],
                    run["run_twice"],
                    c["resumed"],
                    c["jobs"],
                    run["wall"],
                    run["wall"] / calm["wall"],
                    c["invariants"],
                ]
            )
    say(machine_line())
    print(
        table(
            [
                "run", "status", "lost", "duplicated", "run twice", "resumed executions",
                "runner jobs", "wall s", "vs undisturbed", "invariants",
            ],
            rows,
            title=(
                f"Chaos: {args.trials} trials, fuse 2, {args.steps} steps; a slot worker and "
                f"the runner killed, the API restarted, the database cut {args.cut:.0f} s"
            ),
        )
    )  # fmt: skip
    if note := busy_note(load_before):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
