"""Run study definitions through qkscope itself, into ONE database, and keep its export.

    python scripts/repro_via_service.py STUDY.yaml [STUDY.yaml ...] --db PATH --out DIR
        [--metrics] [--fuse auto|N] [--lr-sensitivity]

Starts a local `qkscope serve` (a Ray head of its own on free ports with 2 CPUs, data from
../shared/data) on the SQLite database PATH, which persists between invocations: every
study of a round goes into the same database, so study ids count up and "study N, trial M"
means one thing. For each definition in turn it POSTs the study over REST, waits for
COMPLETED, and downloads the service's own export (`GET /v1/studies/{id}/export`): the
trials table as CSV (`DIR/study-<id>-<name>.trials.csv`: study id and name, trial number,
state, penalty_version, config_hash, code_commit, params and every summary metric) and,
with `--metrics`, the long table of metric rows as Parquet (`...metrics.parquet`). It
With `--lr-sensitivity` it also keeps the service's answer of
`GET /v1/studies/{id}/lr-sensitivity` (default grouping) as `...lr_sensitivity.json`. It
appends one line per study to `DIR/studies.csv`: id, name, definition, trials, wall time
(POST to COMPLETED), fuse, commit.

The code commit the trials record comes from `git rev-parse HEAD`, passed to the Ray workers
as QKSCOPE_CODE_COMMIT (workers/provenance.py), so editing docs while a study runs does not
mark its rows; it carries "+dirty" when workers/, service/ or qkscope/ differ from HEAD.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.orchestration import post_and_wait, start_serve, stop_serve  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
STUDIES_COLUMNS = ["study_id", "name", "definition", "trials", "wall_s", "fuse", "finished_utc"]
STUDIES_COLUMNS += ["code_commit"]


def code_commit() -> str:
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "workers", "service", "qkscope"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return f"{head}+dirty" if dirty else head


def download(c: httpx.Client, sid: int, params: dict[str, Any], path: Path) -> None:
    with c.stream("GET", f"/v1/studies/{sid}/export", params=params) as r:
        r.raise_for_status()
        with path.open("wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)


def run_one(
    c: httpx.Client,
    definition: Path,
    out: Path,
    metrics: bool,
    fuse: str | None,
    commit: str,
    lr_sensitivity: bool = False,
) -> tuple[int, float]:
    spec = yaml.safe_load(definition.read_text())
    if fuse is not None:
        spec["fuse"] = fuse if fuse == "auto" else int(fuse)
    sid, wall, items = post_and_wait(c, spec, poll_s=1.0)
    stem = f"study-{sid}-{spec['name']}"
    download(c, sid, {"format": "csv"}, out / f"{stem}.trials.csv")
    if metrics:
        download(c, sid, {"format": "parquet", "table": "metrics"}, out / f"{stem}.metrics.parquet")
    if lr_sensitivity:
        r = c.get(f"/v1/studies/{sid}/lr-sensitivity")
        r.raise_for_status()
        (out / f"{stem}.lr_sensitivity.json").write_text(r.text)
    index = out / "studies.csv"
    new = not index.exists()
    with index.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(STUDIES_COLUMNS)
        w.writerow(
            [
                sid,
                spec["name"],
                str(definition.relative_to(ROOT))
                if definition.is_relative_to(ROOT)
                else definition,
                len(items),
                f"{wall:.1f}",
                spec.get("fuse", "auto"),
                datetime.now(UTC).isoformat(timespec="seconds"),
                commit,
            ]
        )
    print(f"{definition.name}: study {sid}, {len(items)} trials, {wall:.1f} s", flush=True)
    return sid, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("studies", type=Path, nargs="+")
    p.add_argument("--db", type=Path, required=True, help="SQLite file, kept between runs")
    p.add_argument("--out", type=Path, required=True, help="where the exports go")
    p.add_argument("--metrics", action="store_true", help="also export the metric rows")
    p.add_argument("--fuse", default=None, help="override the definitions' fuse")
    p.add_argument("--lr-sensitivity", action="store_true", help="also keep GET .../lr-sensitivity")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = code_commit()
    os.environ["QKSCOPE_CODE_COMMIT"] = commit  # inherited by the Ray head and its workers
    db = args.db.resolve()
    env = {"QKSCOPE_DATA_DIR": str(DATA), "QKSCOPE_DATABASE_URL": f"sqlite:///{db}"}
    with tempfile.TemporaryDirectory(prefix="qkscope-repro-") as tmp:
        head, proc, api, startup = start_serve(Path(tmp), 2, env)
        print(f"serve up in {startup:.1f} s on {api}, database {db}, commit {commit}", flush=True)
        try:
            with httpx.Client(base_url=api, timeout=300) as c:
                for definition in args.studies:
                    run_one(
                        c,
                        definition.resolve(),
                        args.out,
                        args.metrics,
                        args.fuse,
                        commit,
                        args.lr_sensitivity,
                    )
        finally:
            stop_serve(head, proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
