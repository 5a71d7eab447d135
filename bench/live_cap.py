"""The Ray head's memory with many POSTs against the live-study cap (issue 42).

Each live study costs the head memory (its runner job's driver, Ray's job supervisor actor,
the study's inbox actor, all at num_cpus=0), and nothing capped live studies: about 50 POSTs
ran a 23 GB head out of memory. This starts a real local Ray head (token auth), the app with
`QKSCOPE_MAX_LIVE_STUDIES` (default 16), POSTs `--posts` small long-running studies at once,
and samples the memory of every process of the head's session (PSS from
/proc/<pid>/smaps_rollup, so shared pages count once; RSS beside it) until the admitted
studies run, then for `--hold` seconds; then cancels them and stops the head.

    nice -n 15 python -m bench.live_cap --posts 50 --cap 16

Prints the answers (201 / 429), the head's memory before, at its peak and per live study,
and what `--posts` live studies would need at that rate (the uncapped case, not run: it is
what ran the reviewer's head out of memory).
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:  # field 6 (session), after the name's closing paren
            pids.append(int(entry))
    return pids


def _memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in bytes (0, 0 if it is gone)."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
            elif line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, rss


def head_memory(sid: int) -> tuple[int, int, int]:
    """(PSS, RSS, processes) of the head's session."""
    pss = rss = n = 0
    for pid in _session_pids(sid):
        p, r = _memory(pid)
        pss, rss, n = pss + p, rss + r, n + 1
    return pss, rss, n


def _spec(i: int) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    spec = copy.deepcopy(spec)
    spec["name"] = f"live-cap-{i}"
    spec["budget"] = {"n_trials": 2}
    spec["base"]["steps"] = 100_000  # long enough to stay live while the head is measured
    spec["base"]["eval_every"] = 1000
    spec["parallelism"] = 1
    spec["fuse"] = 1
    return dict(spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--posts", type=int, default=50)
    ap.add_argument("--cap", type=int, default=16, help="QKSCOPE_MAX_LIVE_STUDIES")
    ap.add_argument("--hold", type=float, default=30.0, help="seconds sampled once all run")
    ap.add_argument("--cpus", type=int, default=2, help="the head's --num-cpus")
    args = ap.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ["QKSCOPE_STANDBY"] = "0"  # no standby runner beside the studies measured
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.config import Settings
    from service.control.ray_cluster import LocalRayHead

    tmp = Path(tempfile.mkdtemp(prefix="live-cap-"))
    head = LocalRayHead(
        tmp / "ray", gcs_port=free_port(), dashboard_port=free_port(), num_cpus=args.cpus
    )
    url = head.start()
    assert head.pid is not None
    sid = os.getsid(head.pid)
    time.sleep(5)
    base = head_memory(sid)
    print(
        f"head idle: PSS {base[0] / 2**20:,.0f} MiB, RSS {base[1] / 2**20:,.0f} MiB, {base[2]} processes"
    )
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'q.db'}",
        ray_address=url,
        home=tmp / "home",
        checkpoint_dir=str(tmp / "ckpt"),
        max_live_studies=args.cap,
        reconcile_interval_s=5.0,
    )
    peak = base
    try:
        with TestClient(create_app(settings)) as c:
            t0 = time.monotonic()
            codes = [c.post("/v1/studies", json=_spec(i)).status_code for i in range(args.posts)]
            ids = [s["id"] for s in c.get("/v1/studies", params={"limit": 500}).json()["items"]]
            print(
                f"{args.posts} POSTs in {time.monotonic() - t0:.1f} s: {codes.count(201)} x 201,"
                f" {codes.count(429)} x 429, other {[x for x in codes if x not in (201, 429)]}"
            )
            deadline = time.monotonic() + 900
            running_since: float | None = None
            while time.monotonic() < deadline:
                now = head_memory(sid)
                if now[0] > peak[0]:
                    peak = now
                states = [c.get(f"/v1/studies/{i}").json()["status"] for i in ids]
                if running_since is None and all(s == "RUNNING" for s in states):
                    running_since = time.monotonic()
                    print(
                        f"all {len(ids)} admitted studies RUNNING after {running_since - t0:.0f} s"
                    )
                if running_since is not None and time.monotonic() - running_since > args.hold:
                    break
                time.sleep(2)
            live = len(ids)
            per = (peak[0] - base[0]) / max(live, 1)
            per_rss = (peak[1] - base[1]) / max(live, 1)
            print(
                f"head peak: PSS {peak[0] / 2**20:,.0f} MiB, RSS {peak[1] / 2**20:,.0f} MiB,"
                f" {peak[2]} processes, with {live} live studies"
            )
            print(
                f"per live study: {per / 2**20:,.0f} MiB PSS ({per_rss / 2**20:,.0f} MiB RSS);"
                f" {args.posts} live studies would need about"
                f" {(base[0] + args.posts * per) / 2**30:,.1f} GiB PSS"
                f" ({(base[1] + args.posts * per_rss) / 2**30:,.1f} GiB RSS)"
            )
            for i in ids:
                c.post(f"/v1/studies/{i}/cancel")
    finally:
        head.stop()


if __name__ == "__main__":
    main()
