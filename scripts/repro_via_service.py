"""Run a study definition through qkscope itself and keep its per-trial records.

    python scripts/repro_via_service.py STUDY.yaml OUT.jsonl [--fuse auto|N] [--unfused-too]

Starts a local `qkscope serve` (SQLite, a Ray head of its own with 2 CPUs, data from
../shared/data), POSTs the study over REST, waits for COMPLETED, reads every trial back
through the API (`/v1/studies/{id}/trials`, `/v1/trials/{id}`) and writes one JSON line per
trial: study id, number, state, params and summary (what `scripts/repro_tables.py` and
`scripts/bounded_intervals.py` read). Prints the study id and its wall time (POST to
COMPLETED). With `--unfused-too` the same study runs again with `fuse: 1` on the same
server, for the fused-vs-unfused figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.orchestration import post_and_wait, start_serve, stop_serve  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


def run_study(c: httpx.Client, spec: dict[str, Any]) -> tuple[int, float, list[dict[str, Any]]]:
    sid, wall, items = post_and_wait(c, spec, poll_s=0.5)
    records = []
    for t in sorted(items, key=lambda t: t["number"]):
        full = c.get(f"/v1/trials/{t['id']}").json()
        records.append(
            {
                "study_id": sid,
                "number": t["number"],
                "state": t["state"],
                "params": t["params"],
                "summary": full["summary"],
            }
        )
    return sid, wall, records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--fuse", default=None, help="override the definition's fuse")
    p.add_argument("--unfused-too", action="store_true")
    args = p.parse_args(argv)
    spec = yaml.safe_load(args.study.read_text())
    if args.fuse is not None:
        spec["fuse"] = args.fuse if args.fuse == "auto" else int(args.fuse)
    with tempfile.TemporaryDirectory(prefix="qkscope-repro-") as tmp:
        head, proc, api, _ = start_serve(Path(tmp), 2, {"QKSCOPE_DATA_DIR": str(DATA)})
        try:
            with httpx.Client(base_url=api, timeout=120) as c:
                sid, wall, records = run_study(c, spec)
                print(
                    f"{args.study.name}: study {sid}, fuse {spec.get('fuse', 'auto')}, "
                    f"{len(records)} trials, {wall:.1f} s"
                )
                args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
                if args.unfused_too:
                    sid1, wall1, _ = run_study(c, {**spec, "fuse": 1})
                    print(
                        f"{args.study.name}: study {sid1}, fuse 1, {wall1:.1f} s "
                        f"(fused is {wall1 / wall:.2f}x faster)"
                    )
        finally:
            stop_serve(head, proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
