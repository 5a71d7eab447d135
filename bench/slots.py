"""Fused slots vs one trial at a time on a pruning study, through the REST API.

The same study (quickstart's model and task, a seeded random sampler, the median pruner,
`parallelism: 1`, one CPU per worker) is run by a local `qkscope serve` twice, side by side
in one run: with `fuse: 1` (one trial per Ray task) and with `fuse: 4` (one slot worker of
four member slots: a pruned member leaves its slot at once and the next trial takes it).
With `--groups REF` a third run takes the same study with `fuse: 4` on the code of commit
REF (checked out in a temporary git worktree and put first on PYTHONPATH), where fusion was
built as fixed groups whose stopped members were masked until the group ended.
Printed per run: wall time from POST to COMPLETED, trials per hour, how many were pruned,
the member-steps the trials needed (sum of their steps) and, for the slot worker, the
member-steps it computed (its own count, from the runner's log): with slots the difference,
compute spent on stopped members, is 0.

    .venv/bin/python -m bench.slots [--trials 32] [--steps 400] [--groups d93dac7] [--quick]
        [--fixed-groups]   # also fuse 4 with `refill: false`: today's code, fixed groups
        [--ref REF]   # also fuse 1 and 4 on commit REF, alternating with today's code
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench._common import busy_note, load1, machine_line, say, table
from bench.orchestration import post_and_wait, start_serve, stop_serve

ROOT = Path(__file__).resolve().parents[1]


def spec(trials: int, steps: int, fuse: int, refill: bool = True) -> dict[str, Any]:
    s = yaml.safe_load((ROOT / "study_defs" / "quickstart.yaml").read_text())
    s["name"] = f"slots-bench-fuse-{fuse}" + ("" if refill else "-fixed")
    s["base"].update(steps=steps, device="cpu", dtype="float32")
    s["budget"] = {"n_trials": trials}
    s["sampler"] = {"kind": "random", "seed": 1}
    s["pruner"] = {"kind": "median", "n_startup_trials": 4, "n_warmup_steps": 0}
    s["constraints"] = []
    s.update(parallelism=1, fuse=fuse, resources={"cpus": 1, "gpus": 0})
    if not refill:
        s["refill"] = False
    return s


def computed_steps(work: Path) -> int | None:
    """The slot workers' own member-step counts, from the runner's log ('... ended: N
    member-steps computed ...', in the Ray head's job-driver log under `work`); None for
    `fuse: 1` (no slot worker)."""
    counts = [
        int(m)
        for log in work.rglob("job-driver-*.log")
        for m in re.findall(r"ended: (\d+) member-steps computed", log.read_text(errors="replace"))
    ]
    return sum(counts) if counts else None


def run(
    trials: int,
    steps: int,
    fuse: int,
    work: Path,
    tree: Path | None = None,
    refill: bool = True,
) -> dict[str, Any]:
    saved = os.environ.get("PYTHONPATH")
    if tree is not None:  # the reference code first, for serve, the Ray head and its jobs
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tree), str(_migrations_shim(tree))])
    try:
        # the engine is compared, not the start: every study's job starts cold (no standby)
        head, proc, api, _ = start_serve(work, 1, {"QKSCOPE_STANDBY": "0"})
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        with httpx.Client(base_url=api, timeout=60) as c:
            _, wall, items = post_and_wait(c, spec(trials, steps, fuse, refill))
        time.sleep(1.0)  # the job's last log lines
        return {
            "label": f"fuse {fuse} (groups, {tree.name})"
            if tree
            else ("" if refill else f"fuse {fuse} (fixed groups: refill off)"),
            "fuse": fuse,
            "wall": wall,
            "trials": len(items),
            "pruned": sum(t["state"] == "PRUNED" for t in items),
            "needed": sum(int(t["last_step"]) for t in items),
            "computed": computed_steps(work),
        }
    finally:
        stop_serve(head, proc)


def _migrations_shim(tree: Path) -> Path:
    """A folder that makes `qkscope_migrations` (the installed name of `migrations/`, which
    points at this checkout's) the reference tree's own, put on PYTHONPATH after the tree:
    the reference code's schema, not today's."""
    shim = tree.parent / f"{tree.name}-packages"
    shim.mkdir(exist_ok=True)
    link = shim / "qkscope_migrations"
    if not link.exists():
        link.symlink_to(tree / "migrations")
    return shim


def _worktree(tmp: str, ref: str) -> Path:
    tree = Path(tmp) / ref
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(tree), ref],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    return tree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--quick", action="store_true", help="8 trials of 100 steps")
    p.add_argument("--groups", metavar="REF", help="also run fuse 4 on commit REF (groups)")
    p.add_argument(
        "--ref", metavar="REF", help="also run fuse 1 and fuse 4 on commit REF, alternating"
    )
    p.add_argument(
        "--fixed-groups",
        action="store_true",
        help="also run fuse 4 with refill: false (today's code, fixed groups)",
    )
    args = p.parse_args(argv)
    trials, steps = (8, 100) if args.quick else (args.trials, args.steps)
    say(machine_line())
    load_before = load1()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qkscope-slots-") as tmp:
        results = []
        ref = _worktree(tmp, args.ref) if args.ref else None
        try:
            for fuse in (1, 4):
                for tree in (None, ref) if ref else (None,):
                    work = Path(tmp) / f"fuse-{fuse}-{tree.name if tree else 'now'}"
                    work.mkdir()
                    at = f" at {args.ref}" if tree else ""
                    say(f"fuse {fuse}{at}: {trials} trials x {steps} steps, median pruner")
                    res = run(trials, steps, fuse, work, tree)
                    if tree is not None:
                        res["label"] = f"fuse {fuse} at {args.ref}"
                    results.append(res)
        finally:
            if ref is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(ref)], cwd=ROOT)
        if args.fixed_groups:
            say(f"fuse 4, refill off (fixed groups): {trials} trials x {steps} steps")
            work = Path(tmp) / "fixed-groups"
            work.mkdir()
            results.append(run(trials, steps, 4, work, refill=False))
        if args.groups:
            tree = Path(tmp) / args.groups
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(tree), args.groups],
                check=True,
                cwd=ROOT,
                capture_output=True,
            )
            try:
                say(f"fuse 4 at {args.groups} (groups)")
                work = Path(tmp) / "groups"
                work.mkdir()
                results.append(run(trials, steps, 4, work, tree))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    base = results[0]["wall"]
    for res in results:
        if res["label"].startswith("fuse 4 (groups"):
            computed: Any = "n/a"  # the groups' runner logged no count
        else:
            computed = res["computed"] if res["computed"] is not None else res["needed"]
        rows.append(
            [
                res["label"]
                or f"fuse {res['fuse']}" + (" (slots)" if res["fuse"] > 1 else " (one slot)"),
                f"{res['wall']:.1f}",
                f"{3600 * res['trials'] / res['wall']:.0f}",
                f"{res['pruned']}/{res['trials']}",
                str(res["needed"]),
                str(computed),
                str(computed - res["needed"]) if isinstance(computed, int) else "n/a",
                f"{base / res['wall']:.2f}x",
            ]
        )
    print(
        table(
            [
                "run",
                "wall s",
                "trials/h",
                "pruned",
                "member-steps needed",
                "computed",
                "on stopped members",
                "speed vs fuse 1",
            ],
            rows,
        )
    )
    refill = next((r for r in results if r["fuse"] == 4 and not r["label"]), None)
    fixed = next((r for r in results if "refill off" in r["label"]), None)
    if refill is not None and fixed is not None:
        print(f"refill / fixed groups (same study, fuse 4): {fixed['wall'] / refill['wall']:.2f}x")
    if note := busy_note(load_before):
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
