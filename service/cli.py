"""`qkscope`: serve the API (embedded default: SQLite + a local Ray head), submit studies,
watch them, read results, rank parameters, cancel, stop, and upgrade the database.

Every command that talks to the API goes through `qkscope.Client`; errors are one line with
a hint, printed once, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkscope import ApiError, Client, LrSensitivity, QkscopeError, Trial

if TYPE_CHECKING:
    from service.config import Settings
    from service.control.serve_lock import ServeLock

__all__ = ["main"]

# The plots route's kinds and query parameters (service.read.plots would pull in the server stack).
PLOT_KINDS = ("metric", "scatter", "phase", "pareto", "history", "importance")
PLOT_PARAMS = ("metric", "trials", "layer", "head", "x", "y", "color", "objective")


class CliError(Exception):
    """A one-line error for the user (no traceback)."""


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# Column title -> Trial attribute, in the order the table shows them.
COLUMNS = (
    ("#", "number"),
    ("state", "state"),
    ("value", "value"),
    ("val_loss", "final_val_loss"),
    ("min_H_norm", "min_norm_entropy"),
    ("rank_ratio", "final_rank_ratio"),
    ("qk_var", "qk_eig_var"),
    ("plateau", "plateau_steps"),
    ("E-coll", "entropy_collapse"),
    ("R-coll", "rank_collapse"),
    ("trapped", "trapped"),
    ("pen_v", "penalty_version"),
)


def results_table(qk: Client, study_id: int, limit: int = 50, sort: str = "value") -> str:
    """The study's trials as a text table, with its status line and collapse rates."""
    study = qk.study(study_id)
    trials = qk.trials(study_id, sort=sort, limit=limit)
    summary = qk.summary(study_id)
    params = list(study.search_space)
    cols = [c for c, _ in COLUMNS] + params

    def row(t: Trial) -> list[str]:
        return [_fmt(getattr(t, a)) for _, a in COLUMNS] + [_fmt(t.params.get(p)) for p in params]

    cells = [row(t) for t in trials]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [
        f"study {study_id} '{study.name}': {study.status}, "
        f"{summary.finished}/{study.n_trials} trials, best value {_fmt(summary.best_value)}",
        line,
        "-" * len(line),
    ]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    out += [f"trial {t.number} stopped: {t.stop_reason}" for t in trials if t.stop_reason]
    out.append(
        f"entropy-collapse rate {_fmt(summary.entropy_collapse_rate)}, "
        f"rank-collapse rate {_fmt(summary.rank_collapse_rate)}, "
        f"trapped rate {_fmt(summary.trapped_rate)}"
    )
    return "\n".join(out)


def _progress() -> bool | str:
    """A bar only when both stdout and stderr are terminals; plain lines on change otherwise."""
    return True if sys.stdout.isatty() and sys.stderr.isatty() else "lines"


def _write_plot(qk: Client, args: argparse.Namespace) -> int:
    params = {k: getattr(args, k, None) for k in PLOT_PARAMS}
    if args.json:
        print(json.dumps(qk.plot_data(args.id, args.plot, **params), indent=2))
        return 0
    plot = qk.plot(args.id, args.plot, **params)
    path = args.out or f"study-{args.id}-{args.plot}.png"
    if path == "-":
        sys.stdout.buffer.write(plot.png)
        return 0
    plot.save(path)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _importance(qk: Client, args: argparse.Namespace) -> int:
    if args.plot or args.out:
        out = args.out or f"study-{args.id}-importance.png"
        qk.plot(args.id, "importance", target=args.target, evaluator=args.evaluator).save(out)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    imp = qk.importance(args.id, target=args.target, evaluator=args.evaluator)
    if args.json:
        print(json.dumps(imp.__dict__, indent=2))
        return 0
    print(
        f"study {imp.study_id}: importance for {imp.target} "
        f"({imp.evaluator}, {imp.n_trials} finished trials)"
    )
    width = max((len(k) for k in imp.importances), default=5)
    for name, v in imp.importances.items():
        bar = "#" * round(40 * v / max(max(imp.importances.values()), 1e-12))
        print(f"  {name.ljust(width)}  {v:7.4f}  {bar}")
    return 0


def _table(rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a header row, with a rule below it."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def lr_sensitivity_table(res: LrSensitivity) -> str:
    """Per group: the sensitivity with its interval, l_0 and the seeds used; then the curve
    l(eta) (median over seeds, diverged trials as their l_0; `d` marks diverged seeds)."""
    pct = f"{100 * res.confidence:g} %"
    out = [
        f"study {res.study_id}: LR sensitivity (METRICS.md 9) by "
        f"{', '.join(res.group_by) or 'nothing (one group)'}, grid of {len(res.grid)} "
        f"learning rates {_fmt(res.grid[0])} .. {_fmt(res.grid[-1])}"
        + ("" if res.log_spaced else " (NOT equally spaced in log lr)"),
        "",
    ]
    if not res.groups:
        return "\n".join([*out, "no finished trials yet"])
    rows = [["group", "sensitivity", f"{pct} interval", "l_0", "seeds", "left out"]]
    for g in res.groups:
        interval = "-" if g.ci_low is None else f"[{_fmt(g.ci_low)}, {_fmt(g.ci_high)}]"
        rows.append(
            [g.label, _fmt(g.sensitivity), interval, _fmt(g.l0), str(g.n_seeds),
             str(len(g.left_out))]
        )  # fmt: skip
    out += _table(rows)
    out += ["", "final validation loss l(eta), median over seeds (n seeds, d diverged):"]
    curve = [["lr", *(g.label for g in res.groups)]]
    for i, eta in enumerate(res.grid):
        cells = [_fmt(eta)]
        for g in res.groups:
            p = g.curve[i]
            div = f" {p.diverged}d" if p.diverged else ""
            cells.append("-" if p.median is None else f"{_fmt(p.median)} (n={p.n}{div})")
        curve.append(cells)
    out += _table(curve)
    for g in res.groups:
        out += [f"{g.label}: seed {o['seed']} left out: {o['reason']}" for o in g.left_out]
    return "\n".join(out)


def _client_command(args: argparse.Namespace) -> int:
    with Client() as qk:
        if args.cmd == "submit":
            study = qk.submit(args.file)
            print(f"study {study.id} {study.status} (Ray job {study.ray_job_id})")
            if study.waiting_reason:
                print(f"waiting: {study.waiting_reason}")
            if args.watch:
                qk.wait(study.id, progress=_progress())
            return 0
        if args.cmd == "status":
            s = qk.summary(args.id) if not args.watch else qk.wait(args.id, progress=_progress())
            print(
                json.dumps(
                    {k: v for k, v in s.__dict__.items() if k != "extra"}, default=str, indent=2
                )
            )
            return 0
        if args.cmd == "results":
            if args.plot:
                return _write_plot(qk, args)
            if args.json:
                trials = qk.trials(args.id, sort=args.sort, limit=args.limit)
                print(json.dumps([t.flat() for t in trials], default=str, indent=2))
                return 0
            print(results_table(qk, args.id, limit=args.limit, sort=args.sort))
            return 0
        if args.cmd == "importance":
            return _importance(qk, args)
        if args.cmd == "lr-sensitivity":
            res = qk.lr_sensitivity(args.id, group_by=args.group_by)
            if args.json:
                print(json.dumps(dataclasses.asdict(res), indent=2))
            else:
                print(lr_sensitivity_table(res))
            return 0
        if args.cmd == "export":
            path = qk.export(args.id, args.out, args.format, args.metrics, args.table)
            print(f"wrote {path}", file=sys.stderr)
            return 0
        assert args.cmd == "cancel"
        print(f"study {args.id}: {qk.cancel(args.id).status}")
        return 0


# --- serve / stop ------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run_study(api_url: str, file: str, exit_when_done: bool) -> int | None:
    with Client(api_url) as qk:
        study = qk.submit(file)
        print(
            f"submitted study {study.id} ({study.name}), Ray job {study.ray_job_id}",
            file=sys.stderr,
        )
        final = qk.wait(study.id, progress=_progress())
        print(results_table(qk, study.id))
    if exit_when_done:
        return 0 if final.status == "COMPLETED" else 1
    return None


def _port_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (checked before a Ray head is started for an
    API that could not bind anyway)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def serve(args: argparse.Namespace) -> int:
    """Run the API (and the embedded Ray head) while holding the home's serve lock: a second
    `serve` in the same home refuses before it touches the head, the database or a port."""
    from service.config import get_settings
    from service.control.serve_lock import ServeLock, ServeRunning

    settings = get_settings()
    if not _is_loopback(args.host) and not settings.token_list():
        raise CliError(
            "refusing to serve on a non-loopback address without QKSCOPE_API_TOKENS "
            "(set it, or serve on 127.0.0.1)"
        )
    if args.run and not Path(args.run).is_file():
        raise CliError(f"cannot read {args.run}: no such file")
    api_url = f"http://{args.host}:{args.port}"
    lock = ServeLock(settings.home)
    try:
        lock.acquire()
    except ServeRunning as e:
        raise CliError(str(e)) from None
    try:
        lock.update(api_url=api_url, ray_address=settings.ray_address or None, owns_head=False)
        if not _port_free(args.host, args.port):
            raise CliError(f"cannot serve on {api_url}: the port is in use")
        return _serve_locked(args, settings, lock, api_url)
    finally:
        lock.release()


def _local_head(args: argparse.Namespace, settings: Settings, lock: ServeLock) -> Any:
    """The embedded Ray head: one an earlier `serve` left running (adopted), else a new one;
    `settings.ray_address` then points at it."""
    from service.control.ray_cluster import LocalRayHead

    head = LocalRayHead(
        settings.home,
        dashboard_port=args.dashboard_port,
        gcs_port=args.ray_port,
        num_cpus=args.num_cpus,
    )
    if head.adopt():
        _say(
            f"reusing the local Ray head an earlier `qkscope serve` left running "
            f"(pid {head.pid}, dashboard {head.dashboard_url}); its `serve` is gone, so "
            "this one now owns it and stops it on exit"
        )
        settings.ray_address = head.dashboard_url
    else:
        _say(f"starting a local Ray head (dashboard {head.dashboard_url}, token auth on) ...")
        try:
            settings.ray_address = head.start()
        except (RuntimeError, TimeoutError) as e:  # the log it names says why
            raise CliError(f"could not start a local Ray head: {e}") from None
        _say(f"started the local Ray head (pid {head.pid})")
    lock.update(ray_address=settings.ray_address, owns_head=True, head_pid=head.pid)
    return head


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _serve_locked(
    args: argparse.Namespace, settings: Settings, lock: ServeLock, api_url: str
) -> int:
    import uvicorn

    from service.app import create_app
    from service.control.head_watch import HeadWatchdog

    head = None if settings.ray_address else _local_head(args, settings, lock)
    signal.signal(signal.SIGTERM, _terminate)  # docker stop, kill, `qkscope stop`
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    gave_up: list[str] = []

    def _give_up(why: str) -> None:
        _say(f"qkscope serve: {why}; exiting")
        gave_up.append(why)
        server.should_exit = True

    watchdog = None
    if head is not None:
        watchdog = HeadWatchdog(head, settings.head_check_interval_s, _say, _give_up)
    try:
        return _until_done(args, settings, api_url, server, thread, watchdog, gave_up)
    except KeyboardInterrupt:
        return 0
    finally:
        server.should_exit = True
        if watchdog is not None:
            watchdog.close()
        if thread.is_alive():
            thread.join(timeout=10)
        if head is not None:  # started here, or taken over from a `serve` that died
            head.stop()
            _say("stopped the local Ray head")


def _until_done(
    args: argparse.Namespace,
    settings: Settings,
    api_url: str,
    server: Any,
    thread: threading.Thread,
    watchdog: Any,
    gave_up: list[str],
) -> int:
    """Start the API and the head's watchdog, run `--run`'s study, wait for the end."""
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise CliError(f"the API did not start on {api_url}: see the error above")
        time.sleep(0.1)
    if watchdog is not None:
        watchdog.start()
    _say(
        f"qkscope API on {api_url} (docs {api_url}/docs); web UI {api_url}/ui/; "
        f"Ray dashboard {settings.ray_address}"
    )
    if args.run:
        code = _run_study(api_url, args.run, args.exit_when_done)
        if code is not None:
            return code
    thread.join()
    if gave_up:
        raise CliError(gave_up[0])
    return 0


def stop() -> int:
    """End the `qkscope serve` of this home (QKSCOPE_HOME) and the Ray head it started,
    including a head left behind by a `serve` that was killed with SIGKILL."""
    from service.config import get_settings
    from service.control.ray_cluster import LocalRayHead, pid_alive
    from service.control.serve_lock import SERVE_STATE, running_serve

    home = get_settings().home
    did = []
    record = running_serve(home)
    if record is None:
        (home / SERVE_STATE).unlink(missing_ok=True)  # left by a serve that died
    elif not record.get("pid"):
        raise CliError(f"a `qkscope serve` is starting for home {home}; try again in a moment")
    else:
        pid = int(record["pid"])
        os.kill(pid, signal.SIGTERM)  # serve stops its own Ray head on the way out
        deadline = time.monotonic() + 90
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        did.append(f"stopped qkscope serve (pid {pid}, API {record.get('api_url')})")
    head = LocalRayHead(home)
    if (state := head.recorded()) is not None:
        head._adopted_pid = int(state["pid"])
        head.stop()
        did.append(f"stopped the local Ray head (pid {state['pid']})")
    print("; ".join(did) if did else f"nothing of qkscope's is running for home {home}")
    return 0


# --- the command line ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkscope", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "serve", help="run the API (and a local Ray head unless QKSCOPE_RAY_ADDRESS)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--ray-port", type=int, default=6390)
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--run", metavar="FILE", help="submit this study once the service is up")
    p.add_argument("--exit-when-done", action="store_true", help="with --run: stop when it ends")
    sub.add_parser("stop", help="stop `qkscope serve` and the local Ray head it started")
    p = sub.add_parser("submit", help="submit a study definition (YAML or JSON)")
    p.add_argument("file")
    p.add_argument("--watch", action="store_true")
    p = sub.add_parser("status", help="a study's progress (live with --watch)")
    p.add_argument("id", type=int)
    p.add_argument("--watch", action="store_true")
    p = sub.add_parser("results", help="a study's trials as a table")
    p.add_argument("id", type=int)
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--sort", default="value")
    p.add_argument("--json", action="store_true", help="JSON (with --plot: the plot's data)")
    p.add_argument("--plot", choices=PLOT_KINDS, help="write this plot of the study as a PNG")
    p.add_argument("--out", metavar="FILE", help="with --plot: where (default study-ID-KIND.png)")
    p.add_argument("--metric", help="--plot metric: metric name (default val_loss)")
    p.add_argument("--trials", help="--plot metric: trial numbers, comma-separated")
    p.add_argument("--layer", type=int)
    p.add_argument("--head", type=int)
    p.add_argument("--x", help="--plot scatter/phase: params.<path> or a summary metric")
    p.add_argument("--y", help="--plot scatter/phase: a summary metric or params.<path>")
    p.add_argument("--color", help="--plot scatter: params.<path>, a metric, or none")
    p.add_argument("--objective", type=int, help="--plot history: objective index")
    p = sub.add_parser("importance", help="rank a study's parameters by importance")
    p.add_argument("id", type=int)
    p.add_argument("--target", help="an objective name or summary metric (default objective 0)")
    p.add_argument("--evaluator", choices=["fanova", "ped_anova"], default="fanova")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", action="store_true", help="write the importance plot as a PNG")
    p.add_argument("--out", metavar="FILE", help="with --plot: where")
    p = sub.add_parser(
        "lr-sensitivity", help="learning-rate sensitivity per group (METRICS.md section 9)"
    )
    p.add_argument("id", type=int)
    p.add_argument(
        "--group-by",
        action="append",
        metavar="PARAM",
        help="a parameter whose values make the groups (repeatable; default every searched "
        "parameter but optim.lr and seed)",
    )
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("export", help="a study's trials (and metric rows) as CSV or Parquet")
    p.add_argument("id", type=int)
    p.add_argument("--format", choices=["csv", "parquet"], default="csv")
    p.add_argument("--metrics", action="store_true", help="a zip of trials and metric rows")
    p.add_argument("--table", choices=["trials", "metrics"], help="just this table")
    p.add_argument("--out", metavar="FILE", help="default: the name the server suggests")
    p = sub.add_parser("cancel", help="cancel a study")
    p.add_argument("id", type=int)
    p = sub.add_parser("db", help="database maintenance")
    p.add_argument("action", choices=["upgrade"])
    return parser


def _api_hint(e: ApiError) -> str:
    if e.status == 401:
        return " (set QKSCOPE_API_TOKEN to one of the service's QKSCOPE_API_TOKENS)"
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        if args.cmd == "serve":
            return serve(args)
        if args.cmd == "stop":
            return stop()
        if args.cmd == "db":
            from service.config import get_settings
            from service.store import upgrade_schema

            upgrade_schema(get_settings().resolved_database_url())
            print("database is at the latest schema")
            return 0
        return _client_command(args)
    except ApiError as e:
        print(f"qkscope: error {e.status}: {e.message}{_api_hint(e)}", file=sys.stderr)
    except (QkscopeError, CliError, OSError, TimeoutError) as e:
        print(f"qkscope: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
