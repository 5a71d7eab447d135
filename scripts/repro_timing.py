"""Wall time of a study definition through the service, fused vs `fuse: 1`, in ABBA order.

    python scripts/repro_timing.py STUDY.yaml [--fuse auto|N] [--rounds 1]

Starts one local `qkscope serve` (as scripts/repro_via_service.py does), then submits the
definition with `fuse: 1` (A) and with `--fuse` (B, default: the definition's own) in the
order A B B A per round, so a load that drifts during the run hits both alike; prints each
study's wall time (POST to COMPLETED), the median of each and their ratio. Every run must
end with every trial COMPLETE, or the figure would time failures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.orchestration import post_and_wait, start_serve, stop_serve  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", type=Path)
    p.add_argument("--fuse", default=None, help="B's fuse (default: the definition's)")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    spec = yaml.safe_load(args.study.read_text())
    fused = spec.get("fuse", "auto") if args.fuse is None else args.fuse
    fused = fused if fused == "auto" else int(fused)
    order = [1, fused, fused, 1] * args.rounds
    walls: dict[object, list[float]] = {1: [], fused: []}
    with tempfile.TemporaryDirectory(prefix="qkscope-timing-") as tmp:
        head, proc, api, _ = start_serve(Path(tmp), 2, {"QKSCOPE_DATA_DIR": str(DATA)})
        try:
            with httpx.Client(base_url=api, timeout=120) as c:
                for fuse in order:
                    load = os.getloadavg()[0]
                    sid, wall, items = post_and_wait(c, {**spec, "fuse": fuse}, poll_s=0.5)
                    states = {t["state"] for t in items}
                    assert states == {"COMPLETE"}, (sid, states)
                    walls[fuse].append(wall)
                    print(f"study {sid}: fuse {fuse}, {len(items)} trials, {wall:.1f} s "
                          f"(1-min load {load:.1f} at the start)", flush=True)  # fmt: skip
        finally:
            stop_serve(head, proc)
    one, other = statistics.median(walls[1]), statistics.median(walls[fused])
    print(f"{args.study.name}: median fuse 1 {one:.1f} s, fuse {fused} {other:.1f} s: "
          f"fuse {fused} is {one / other:.2f}x as fast")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
