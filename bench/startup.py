"""POST to first training step on a running service: a warm start (the standby runner,
the default) against a cold one (`QKSCOPE_STANDBY=0`: a Ray job per study started at the
POST) and against a bare Ray job doing the same first step, in the same run.

- qkscope: `qkscope serve` already up on its own Ray head; POST a 1-trial study whose trial
  evaluates after every step; poll the API every 20 ms. Reported: POST answered, POST -> the
  runner job started (study.started_at), -> the trial task started (trial.started_at, the
  task's own clock), -> the first training step's metrics stored (the step-1 `train_loss`
  row is visible through the API: the study's first result). With the standby on, each
  round first waits until `/metrics` shows a ready standby (the reconciler replaces the one
  the last round used while the service is idle).
- bare Ray job: `JobSubmissionClient.submit_job` of a one-line driver that runs one Ray task
  with `run_trial` for one step of the same config; the task writes the time it finished.
  Reported: submit -> that step done. It is the floor for any service that starts a Ray job
  per study (job driver start, `ray.init`, a task, torch import, data, model).

    python -m bench.startup              # 5 rounds each (round 0 of each line is dropped)
    python -m bench.startup --quick      # 2 rounds
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench._common import busy_note, load1, machine_line, say, standby_ready, table
from bench.orchestration import ROOT, base_config, start_serve, stop_serve

GOAL_S = 1.0  # issue 36: the first result within about a second of the POST


def _spec(i: int) -> dict[str, Any]:
    base = base_config(steps=3) | {"eval_every": 1, "seed": i}
    base["optim"] = base["optim"] | {"warmup_steps": 0}
    return {
        "name": f"bench-startup-{i}",
        "base": base,
        "search_space": {"regularizer.lambda": {"type": "fixed", "value": 0.01}},
        "sampler": {"kind": "random", "seed": i},
        "pruner": {"kind": "none"},
        "budget": {"n_trials": 1},
        "parallelism": 1,
        "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
        "resources": {"cpus": 1, "gpus": 0},
        "max_retries": 0,
    }


def _ts(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def qkscope_round(c: httpx.Client, i: int, warm: bool) -> dict[str, float]:
    if warm:
        standby_ready(c)
    time.sleep(1.0)  # the same quiet second before every POST, warm or cold
    t_post = time.time()
    r = c.post("/v1/studies", json=_spec(i))
    r.raise_for_status()
    t_answer = time.time()
    sid = r.json()["id"]
    first_step = None
    while first_step is None:
        if time.time() - t_post > 300:
            raise TimeoutError(f"study {sid}: no step-1 metrics after 300 s")
        page = c.get(f"/v1/studies/{sid}/trials").json()
        if page["items"]:
            tid = page["items"][0]["id"]
            rows = c.get(f"/v1/trials/{tid}/metrics", params={"name": "train_loss"}).json()
            if any(p["step"] >= 1 for p in rows):
                first_step = time.time()
                break
        time.sleep(0.02)
    while True:  # let it finish so the next round starts on an idle cluster
        study = c.get(f"/v1/studies/{sid}").json()
        if study["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.1)
    trial = c.get(f"/v1/studies/{sid}/trials").json()["items"][0]
    return {
        "POST answered": t_answer - t_post,
        "job started": _ts(study["started_at"]) - t_post,
        "trial task started": _ts(trial["started_at"]) - t_post,
        "first step stored": first_step - t_post,
    }


_BARE_DRIVER = """
import json, sys, time, ray
from workers.trial import TrialConfig, run_trial
ray.init()
cfg = json.loads(sys.argv[1]); out = sys.argv[2]
@ray.remote(num_cpus=1)
def one_step(cfg):
    run_trial(TrialConfig.model_validate(cfg))
    return time.time()
done = ray.get(one_step.remote(cfg))
open(out, "w").write(str(done))
"""


def bare_round(head: Any, work: Path, i: int) -> dict[str, float]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    cfg = base_config(steps=1) | {"eval_every": 1, "seed": i}
    cfg["optim"] = cfg["optim"] | {"warmup_steps": 0}
    out = work / f"bare-{i}.txt"
    driver = work / "bare_driver.py"
    driver.write_text(_BARE_DRIVER)
    client = JobSubmissionClient(head.address, headers={"Authorization": f"Bearer {head.token}"})
    t_submit = time.time()
    job = client.submit_job(
        entrypoint=f"python {driver} '{json.dumps(cfg)}' {out}",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
        if time.time() - t_submit > 300:
            raise TimeoutError("bare job not done after 300 s")
        time.sleep(0.05)
    if not out.exists():
        raise RuntimeError(f"bare job failed: {client.get_job_logs(job)[-2000:]}")
    return {"first step done": float(out.read_text()) - t_submit}


LINES = {"warm": "qkscope, standby runner (default)", "cold": "qkscope, QKSCOPE_STANDBY=0"}


def run_line(work: Path, line: str, rounds: int) -> list[dict[str, float]]:
    """`rounds` + 1 studies on a fresh `serve` (round 0 dropped), warm or cold."""
    extra = {} if line == "warm" else {"QKSCOPE_STANDBY": "0"}
    head, proc, api, up = start_serve(work / line, concurrency=2, extra_env=extra)
    out: list[dict[str, float]] = []
    try:
        say(f"  {line}: serve up in {up:.1f} s; {rounds} rounds (+1 dropped)")
        with httpx.Client(base_url=api, timeout=60) as c:
            for i in range(rounds + 1):
                r = qkscope_round(c, i, warm=line == "warm")
                if i > 0:
                    out.append(r)
                say(f"  {line} round {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    finally:
        stop_serve(head, proc)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    load_before = load1()
    med: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="qkscope-bench-startup-") as tmp:
        work = Path(tmp)
        for line in LINES:
            (work / line).mkdir()
            q = run_line(work, line, rounds)
            med[line] = {k: statistics.median(r[k] for r in q) for k in q[0]}
        from bench._common import RayHead

        head = RayHead(work / "bare-ray", 2)
        head.start()
        try:
            b = []
            for i in range(rounds + 1):
                time.sleep(1.0)
                br = bare_round(head, work, i)
                if i > 0:
                    b.append(br)
                say(f"  bare round {i}: {br}")
        finally:
            head.stop()
    bare = statistics.median(r["first step done"] for r in b)
    rows = []
    for step in ("POST answered", "job started", "trial task started", "first step stored"):
        w, c = med["warm"][step], med["cold"][step]
        rows.append([f"POST -> {step}", w, c, f"{c / w:.1f}x" if w > 0 else "-"])
    rows.append(["bare Ray job: submit -> first step done", "", bare, ""])
    print(machine_line())
    print(
        table(
            ["median s", LINES["warm"], LINES["cold"], "cold / warm"],
            rows,
            title=f"startup on a running service, {rounds} rounds each; goal <= {GOAL_S:.0f} s",
        )
    )
    w = med["warm"]["first step stored"]
    print(
        f"\nfirst result: warm {w:.2f} s, cold {med['cold']['first step stored']:.2f} s, "
        f"bare Ray job {bare:.2f} s (bare / warm {bare / w:.1f}x)"
    )
    note = busy_note(load_before)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
