"""Run a grid study definition locally, without the service, and summarise it over seeds.

    python scripts/run_grid.py run STUDY.yaml OUT.jsonl [--workers 2] [--data-root DIR]
    python scripts/run_grid.py table OUT.jsonl METRIC [METRIC ...]

`run` expands the grid exactly as the grid sampler would (every combination of the
search space's grid lists and categorical choices), builds each trial's config with the
service's own `apply_params`, and trains it with `workers.trial.run_trial` on the CPU, one
torch thread per worker process. Each finished trial is one JSON line: its params and its
TrialSummary. `table` groups the trials by every parameter except `seed` and prints, per
group and metric, the mean over seeds, a 95 % Student-t interval and every seed's value.

Used for the CPU runs in docs/reproductions.md; the service gives the same trials (the
same `apply_params` and `run_trial`) when a study is submitted to it instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def grid_points(spec: Any) -> list[dict[str, Any]]:
    axes: list[tuple[str, list[Any]]] = []
    for path, p in spec.search_space.items():
        if p.type == "categorical":
            axes.append((path, list(p.choices)))
        elif p.type == "fixed":
            axes.append((path, [p.value]))
        else:
            if p.grid is None:
                raise SystemExit(f"{path}: not a grid parameter")
            axes.append((path, list(p.grid)))
    names = [a for a, _ in axes]
    return [
        dict(zip(names, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))
    ]


def _one(args: tuple[str, dict[str, Any], str]) -> dict[str, Any]:
    import torch

    from service.spec import apply_params, parse_spec
    from workers.trial import run_trial

    torch.set_num_threads(1)
    spec_path, params, data_root = args
    spec = parse_spec(Path(spec_path).read_bytes(), "application/yaml")
    cfg = apply_params(spec.base, params)
    if cfg.task.data_dir and not Path(cfg.task.data_dir).is_absolute():
        task = cfg.task.model_copy(update={"data_dir": str(Path(data_root) / cfg.task.data_dir)})
        cfg = cfg.model_copy(update={"task": task})
    cfg = cfg.model_copy(update={"device": "cpu"})
    t0 = time.process_time()
    summary = run_trial(cfg)
    return {
        "params": params,
        "summary": summary.model_dump(mode="json"),
        "cpu_s": time.process_time() - t0,
    }


def run(spec_path: str, out: str, workers: int, data_root: str) -> None:
    from service.spec import parse_spec

    spec = parse_spec(Path(spec_path).read_bytes(), "application/yaml")
    points = grid_points(spec)
    print(f"{spec.name}: {len(points)} trials, {workers} workers", file=sys.stderr)
    with Path(out).open("w") as f, ProcessPoolExecutor(workers) as pool:
        jobs = [(spec_path, p, data_root) for p in points]
        for i, rec in enumerate(pool.map(_one, jobs)):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            print(f"  {i + 1}/{len(points)} {rec['params']} {rec['cpu_s']:.1f}s", file=sys.stderr)


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and a 95 % Student-t interval (half-width 0 for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def table(path: str, metrics: list[str]) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        key = json.dumps({k: v for k, v in rec["params"].items() if k != "seed"}, sort_keys=True)
        groups.setdefault(key, []).append(rec)
    for key, recs in groups.items():
        cells = []
        for m in metrics:
            vals = [r["summary"].get(m) for r in recs]
            xs = [float(v) for v in vals if v is not None]
            if not xs:
                cells.append(f"{m}: n/a")
                continue
            mean, lo, hi = interval(xs)
            seeds = ", ".join(f"{x:.3g}" for x in xs)
            cells.append(f"{m}: {mean:.4g} [{lo:.4g}, {hi:.4g}] ({seeds})")
        print(key, "|", " | ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("spec")
    r.add_argument("out")
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--data-root", default="/work/shared/data")
    t = sub.add_parser("table")
    t.add_argument("results")
    t.add_argument("metrics", nargs="+")
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.spec, a.out, a.workers, a.data_root)
    else:
        table(a.results, a.metrics)


if __name__ == "__main__":
    main()
