"""How long `qkscope serve` is without a Ray head after the head's GCS dies.

    .venv/bin/python -m bench.head_restart [--rounds 2] [--quick]

`LocalRayHead.restart` (what serve's head watchdog calls) stops what is left of the dead
head and starts a new one on the same ports. Side by side on the same machine, alternating:
the restart as it is (the remains get 2 s to exit, then their process group is killed) and
the same restart with the graceful stop it replaced (`stop()`'s default: SIGTERM, up to 60 s
for `ray start --block` to exit). Each round starts a head, SIGKILLs its GCS, and times
restart until the new head's job server answers.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench._common import Timer, busy_note, free_port, load1, machine_line, say, table
from service.control.ray_cluster import LocalRayHead


def _kill_gcs(port: int) -> None:
    pids = subprocess.run(
        ["pgrep", "-f", f"gcs_server_port={port}"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "no GCS process found"
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    time.sleep(1.0)  # the watchdog notices within its check interval; not timed here


def one_round(home: Path, graceful: bool) -> float:
    home.mkdir(parents=True)
    head = LocalRayHead(home, gcs_port=free_port(), dashboard_port=free_port(), num_cpus=1)
    head.start()
    try:
        _kill_gcs(head.gcs_port)
        with Timer() as t:
            if graceful:  # the restart before this change: stop() with its 60 s grace
                head.stop()
                head.start()
            else:
                head.restart()
        return t.s
    finally:
        head.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one round")
    args = p.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    load_before = load1()
    times: dict[str, list[float]] = {
        "restart (2 s, then kill)": [],
        "graceful stop, then start": [],
    }
    with tempfile.TemporaryDirectory(prefix="qkbench-") as tmp:
        for r in range(rounds):
            for graceful in (r % 2 == 1, r % 2 == 0):  # alternate which goes first
                name = "graceful stop, then start" if graceful else "restart (2 s, then kill)"
                s = one_round(Path(tmp) / f"h{r}{int(graceful)}", graceful)
                say(f"round {r}: {name}: {s:.1f} s")
                times[name].append(s)
    # After the rounds: machine_line imports ray, and a process that imported ray before a
    # head's token was in its environment sends no token to that head's job server.
    say(machine_line())
    new = statistics.median(times["restart (2 s, then kill)"])
    old = statistics.median(times["graceful stop, then start"])
    rows = [
        [name, len(ts), statistics.median(ts), statistics.median(ts) / old]
        for name, ts in times.items()
    ]
    print(
        table(
            ["head restart after its GCS died", "rounds", "median s", "vs graceful"],
            rows,
            title=f"Ray head restart: {new:.1f} s vs {old:.1f} s ({old / new:.1f}x faster)",
        )
    )
    if note := busy_note(load_before):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
