"""Run every benchmark, one after another, and print all their tables at the end.

    .venv/bin/python -m bench                  # every benchmark at default size
    .venv/bin/python -m bench --quick          # smoke sizes
    .venv/bin/python -m bench --only ingest,queries
    bench/run_all.sh [--quick]                 # the same, from the repository root

Each benchmark runs as its own process (`python -m bench.<name>`), so one failing does not
stop the others; the exit status is non-zero if any failed. Progress goes to stderr, the
tables to stdout (the same Markdown tables as bench/README.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

BENCHES = [
    "train_throughput",
    "orchestration",
    "ingest",
    "queries",
    "sampler_cost",
    "load",
    "startup",
    "ui",
    "head_restart",
]
EXTRA = {"train_throughput": ["--threads", "1"]}  # the README's figures use one thread


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run every qkscope benchmark")
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset")
    args = p.parse_args(argv)
    outputs: list[tuple[str, int, float, str]] = []
    for name in [b.strip() for b in args.only.split(",") if b.strip()]:
        if name not in BENCHES:
            print(f"unknown benchmark {name!r}; one of {BENCHES}", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", f"bench.{name}", *EXTRA.get(name, [])]
        if args.quick:
            cmd.append("--quick")
        print(f"==> {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        took = time.perf_counter() - t0
        sys.stderr.write(proc.stdout)
        outputs.append((name, proc.returncode, took, proc.stdout))
    print("# qkscope benchmarks\n")
    for name, rc, took, out in outputs:
        status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"## {name}: {status}, {took:.0f} s\n")
        print(out.rstrip() + "\n")
    return 0 if all(rc == 0 for _, rc, _, _ in outputs) else 1


if __name__ == "__main__":
    sys.exit(main())
