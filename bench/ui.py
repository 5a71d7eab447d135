"""The web UI's speed in headless Chromium, against the API's own JSON latency in the same run.

Two pages, each at the size the issue names:

- the study page of a study with `--trials` trials (default 10,000; the synthetic trials of
  bench/queries.py, two search-space parameters);
- the trial page of one trial with `--rows` metric rows (default 100,000: a 4-layer, 8-head
  model evaluated ~725 times, so the entropy heatmap has 32 x 725 cells).

Loaded through the project's own paths (trial rows in bulk, metric rows through
`service.store.ingest.insert_metrics`) into a throwaway PostgreSQL database (`--db sqlite` for
a file), served by uvicorn in this process. Per page, `--runs` cold loads (a new browser
context each: no cache) of `/ui/#/...`, timing from navigation start:

- first paint: the browser's first-contentful-paint (the page shell);
- time to data: the page's `qk:data:<page>` mark (summary and the first 50 rows of the
  trial table; every chart of the trial page), and for the study page also the charts
  (history and phase map of all trials) and the importance panel (drawn last; PED-ANOVA past
  200 trials, see service/ui/static/js/study.js).

Baseline: the same JSON calls the page makes before that mark, timed with httpx against the
same server (medians of `--runs`); the ratio says what the browser adds on top.

    python -m bench.ui                  # 10,000 trials, 100,000 rows (a minute to load)
    python -m bench.ui --quick          # 1,000 trials, 20,000 rows
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench._common import (
    busy_note,
    free_port,
    load1,
    machine_line,
    pg_available,
    pg_database,
    say,
    table,
)

GOAL_S = 1.0
CHROMIUM = "/usr/bin/chromium"
BIG_LAYERS, BIG_HEADS = 4, 8
PER_HEAD = ("attn_entropy", "attn_entropy_norm", "qk_eig_mean", "qk_eig_var")
SCALARS = ("train_loss", "val_loss", "grad_norm", "lr", "reg_penalty")
# What the trial page fetches (service/ui/static/js/trial.js, DRAWN).
DRAWN = ("train_loss", "val_loss", "attn_entropy_norm", "rank_ratio", "qk_eig_mean", "qk_eig_var",
         "reg_penalty")  # fmt: skip


def big_trial_rows(trial_id: int, rows: int, rng: random.Random) -> list[dict[str, Any]]:
    """`rows` metric rows of one trial: whole evaluations of a 4-layer 8-head model."""
    per_eval = len(SCALARS) + (BIG_LAYERS + 1) + BIG_LAYERS * BIG_HEADS * len(PER_HEAD)
    out: list[dict[str, Any]] = []
    for e in range(math.ceil(rows / per_eval)):
        step = 10 * (e + 1)
        pts = [(n, -1, -1) for n in SCALARS] + [
            ("rank_ratio", ly, -1) for ly in range(BIG_LAYERS + 1)
        ]
        pts += [
            (n, ly, hd)
            for ly in range(1, BIG_LAYERS + 1)
            for hd in range(BIG_HEADS)
            for n in PER_HEAD
        ]
        for name, layer, head in pts:
            if len(out) == rows:
                return out
            out.append({"trial_id": trial_id, "name": name, "layer": layer, "head": head,
                        "step": step, "value": rng.random()})  # fmt: skip
    return out


def load(url: str, n_trials: int, n_rows: int) -> tuple[int, int]:
    """The big study and the big trial (in a study of its own); their ids."""
    from sqlalchemy import insert, select, text

    from bench.queries import SPEC, synth_trial
    from service.store import (
        Study,
        Trial,
        insert_metrics,
        make_engine,
        make_sessionmaker,
        session_scope,
        upgrade_schema,
    )

    upgrade_schema(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    rng = random.Random(0)
    cols = {c.name for c in Trial.__table__.columns}
    with session_scope(sessions) as s:
        study = Study(name="bench-ui", status="RUNNING", spec=SPEC | {"budget": {"n_trials": n_trials}},
                      n_trials=n_trials, optuna_study_name="bench-ui")  # fmt: skip
        big_spec = SPEC | {"name": "bench-ui-trial"}
        big_spec["base"] = SPEC["base"] | {
            "model": {"n_layers": BIG_LAYERS, "n_heads": BIG_HEADS, "d_model": 64}
        }
        big = Study(name="bench-ui-trial", status="COMPLETED", spec=big_spec, n_trials=1,
                    optuna_study_name="bench-ui-trial")  # fmt: skip
        s.add_all([study, big])
        s.flush()
        sid, bid = study.id, big.id
    with session_scope(sessions) as s:
        trials = [synth_trial(n, rng, 8) for n in range(n_trials)]
        for i in range(0, n_trials, 2000):
            s.execute(insert(Trial), [{k: v for k, v in t.items() if k in cols} | {"study_id": sid}
                                      for t in trials[i : i + 2000]])  # fmt: skip
        t = synth_trial(0, rng, 8)
        s.execute(
            insert(Trial),
            [{k: v for k, v in t.items() if k in cols} | {"study_id": bid, "state": "COMPLETE"}],
        )
    with session_scope(sessions) as s:
        tid = int(s.scalar(select(Trial.id).where(Trial.study_id == bid)) or 0)
        insert_metrics(s, big_trial_rows(tid, n_rows, rng))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE" if url.startswith("postgresql") else "ANALYZE"))
    engine.dispose()
    return sid, tid


@contextlib.contextmanager
def serve(url: str, home: Path) -> Iterator[str]:
    import uvicorn

    from service.app import create_app
    from service.config import Settings

    settings = Settings(database_url=url, ray_address="", api_tokens="", home=home)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, reconcile_loop=False),
                                           host="127.0.0.1", port=port, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def api_baseline(base: str, calls: list[str], runs: int) -> tuple[float, dict[str, float]]:
    """Median seconds of each call (sequential, as the page's critical path), and their sum."""
    import httpx

    per: dict[str, list[float]] = {c: [] for c in calls}
    with httpx.Client(base_url=base, timeout=120) as c:
        for c_ in calls:
            c.get(c_).raise_for_status()  # warm: imports, caches, the first connection
        for _ in range(runs):
            for path in calls:
                t0 = time.perf_counter()
                r = c.get(path)
                r.json()
                per[path].append(time.perf_counter() - t0)
    med = {p: statistics.median(v) for p, v in per.items()}
    return sum(med.values()), med


def browser_runs(base: str, hash_: str, marks: list[str], runs: int) -> dict[str, float]:
    """Median first paint and the named marks (seconds from navigation start), and the
    median time each chart took to draw (`draw <chart>`, from the page's qk:draw measures)."""
    from playwright.sync_api import sync_playwright

    got: dict[str, list[float]] = {"first paint": [], **{m: [] for m in marks}}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        for i in range(runs + 1):  # the first is a warm-up (server side caches, JIT)
            ctx = b.new_context(viewport={"width": 1400, "height": 1000})
            page = ctx.new_page()
            page.goto(f"{base}/ui/{hash_}")
            for m in marks:
                page.wait_for_function(
                    f"() => performance.getEntriesByName('{m}').length > 0", timeout=120_000
                )
            t = page.evaluate(
                """marks => ({
                  fcp: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime,
                  marks: marks.map(m => performance.getEntriesByName(m)[0].startTime),
                  draws: performance.getEntriesByType('measure').filter(e => e.name.startsWith('qk:draw:'))
                    .map(e => [e.name.slice(8).replace(/-[0-9]+$/, ''), e.duration]),
                })""",
                marks,
            )
            if i > 0:
                got["first paint"].append(t["fcp"] / 1000)
                for m, v in zip(marks, t["marks"], strict=True):
                    got[m].append(v / 1000)
                for name, ms in t["draws"]:  # what drawing each chart cost (the last time)
                    got.setdefault(f"draw {name}", []).append(ms / 1000)
            ctx.close()
        b.close()
    return {k: statistics.median(v) for k, v in got.items()}


def draw_note(page: str, got: dict[str, float]) -> str:
    draws = ", ".join(f"{k[5:]} {1000 * v:.0f}" for k, v in got.items() if k.startswith("draw "))
    return f"{page}: drawing each chart (ms, median): {draws}"


def measure(base: str, sid: int, tid: int, runs: int) -> tuple[list[list[Any]], list[str]]:
    import httpx

    bid = httpx.get(f"{base}/v1/trials/{tid}").json()["study_id"]
    study_calls = ["/v1/ui/config", f"/v1/studies/{sid}", f"/v1/studies/{sid}/summary",
                   f"/v1/studies/{sid}/trials?sort=number&limit=50&offset=0"]  # fmt: skip
    chart_calls = [f"/v1/studies/{sid}/plots/history?format=json",
                   f"/v1/studies/{sid}/plots/scatter?format=json&x=params.regularizer.lambda"
                   "&y=params.model.qk_init_std&color=collapse_class"]  # fmt: skip
    drawn = "&".join(f"name={n}" for n in DRAWN)  # the series the trial page draws
    trial_calls = [
        "/v1/ui/config",
        f"/v1/trials/{tid}",
        f"/v1/studies/{bid}",
        f"/v1/trials/{tid}/series?{drawn}",
    ]
    say("API baseline ...")
    api_study, _ = api_baseline(base, study_calls, runs)
    api_charts, _ = api_baseline(base, chart_calls, runs)
    api_trial, med_trial = api_baseline(base, trial_calls, runs)
    api_rows, _ = api_baseline(base, [f"/v1/trials/{tid}/metrics"], runs)
    api_series, _ = api_baseline(base, [f"/v1/trials/{tid}/series"], runs)
    importance = f"/v1/studies/{sid}/importance?evaluator=ped_anova"  # what the page asks at 10,000
    api_importance, _ = api_baseline(base, [importance], runs)
    say("browser: study page ...")
    # Each run waits for the importance panel too: left running, its computation would
    # spill into the next run (and the trial page's).
    st = browser_runs(base, f"#/studies/{sid}",
                      ["qk:data:study", "qk:data:studycharts", "qk:data:importance"], runs)  # fmt: skip
    say("browser: trial page ...")
    tr = browser_runs(base, f"#/trials/{tid}", ["qk:data:trial"], runs)
    notes = [draw_note("study page", st), draw_note("trial page", tr)]
    return [
        ["study page: first paint", st["first paint"], None, None],
        ["study page: summary + trial table", st["qk:data:study"], api_study, st["qk:data:study"] / api_study],
        ["study page: + history and phase map", st["qk:data:studycharts"], api_study + api_charts,
         st["qk:data:studycharts"] / (api_study + api_charts)],
        ["study page: + importance panel (PED-ANOVA)", st["qk:data:importance"], api_importance,
         st["qk:data:importance"] / api_importance],
        ["trial page: first paint", tr["first paint"], None, None],
        ["trial page: every chart drawn", tr["qk:data:trial"], api_trial, tr["qk:data:trial"] / api_trial],
        ["(API only) /series, the drawn series", None, med_trial[f"/v1/trials/{tid}/series?{drawn}"], None],
        ["(API only) /series, all rows grouped", None, api_series, None],
        ["(API only) /metrics, one object per row", None, api_rows, api_rows / api_series],
    ], notes  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=10_000)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--db", choices=["postgresql", "sqlite"], default=None)
    p.add_argument("--quick", action="store_true", help="1,000 trials, 20,000 rows, 3 runs")
    args = p.parse_args(argv)
    if args.quick:
        args.trials, args.rows, args.runs = 1000, 20_000, 3
    if not Path(CHROMIUM).exists():
        say(f"no Chromium at {CHROMIUM}: apt-get install chromium")
        return 2
    db = args.db or ("postgresql" if pg_available() is None else "sqlite")
    before = load1()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-ui-")))
        url = (
            stack.enter_context(pg_database("qkscope_bench_ui"))
            if db == "postgresql"
            else f"sqlite:///{tmp / 'ui.db'}"
        )
        say(f"loading {args.trials:,} trials and a {args.rows:,}-row trial into {db} ...")
        t0 = time.perf_counter()
        sid, tid = load(url, args.trials, args.rows)
        say(f"  loaded in {time.perf_counter() - t0:.0f} s")
        base = stack.enter_context(serve(url, tmp))
        rows, notes = measure(base, sid, tid, args.runs)
    print(machine_line())
    print(table(
        ["what (median of cold loads)", "browser s", "API JSON s", "browser / API"],
        rows,
        title=f"Web UI, {db}: study page at {args.trials:,} trials, trial page at {args.rows:,} metric rows",
    ))  # fmt: skip
    print("\n".join(["", *notes]))
    # The goal covers first paint and the page's data (table, charts); the importance panel
    # is computed by the API on demand and drawn last: reported above, not in the goal.
    worst = max(r[1] for r in rows if r[1] is not None and "importance" not in r[0])
    print(
        f"\ngoal: every browser figure < {GOAL_S} s: {'met' if worst < GOAL_S else 'NOT met'} (worst {worst:.3f} s)"
    )
    note = busy_note(before)
    if note:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
