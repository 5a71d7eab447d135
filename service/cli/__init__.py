"""`qkscope`: serve the API (embedded default: SQLite + a local Ray head), submit studies,
watch them, read results, rank parameters, cancel, stop, and upgrade the database.

Every command that talks to the API goes through `qkscope.Client`; errors are one line with
a hint, printed once, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from qkscope import ApiError, Client, QkscopeError
from service.cli.format import (
    COLUMNS,
    lr_sensitivity_table,
    progress_style,
    results_table,
    stability_boundary_table,
)
from service.cli.serve import CliError, serve, stop
from service.cli.serve import is_loopback as _is_loopback  # noqa: F401  (the old name)

# The commands live in three modules: this one (the parser, the client commands, `main`),
# service/cli/format.py (tables) and service/cli/serve.py (`serve`, `stop`); their names
# stay importable from here.
__all__ = [
    "COLUMNS",
    "PLOT_KINDS",
    "CliError",
    "lr_sensitivity_table",
    "stability_boundary_table",
    "main",
    "results_table",
    "serve",
    "stop",
]

# The plots route's kinds and query parameters (service.read.plots would pull in the server stack).
PLOT_KINDS = ("metric", "scatter", "phase", "pareto", "history", "importance")
PLOT_PARAMS = ("metric", "trials", "layer", "head", "x", "y", "color", "objective")


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


def _client_command(args: argparse.Namespace) -> int:
    with Client() as qk:
        if args.cmd == "submit":
            study = qk.submit(args.file)
            print(f"study {study.id} {study.status} (Ray job {study.ray_job_id})")
            if study.waiting_reason:
                print(f"waiting: {study.waiting_reason}")
            if args.watch:
                qk.wait(study.id, progress=progress_style())
            return 0
        if args.cmd == "status":
            s = qk.wait(args.id, progress=progress_style()) if args.watch else qk.summary(args.id)
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
                from service.store import jsonable  # an infinity as "inf", as the API has it

                rows = [jsonable(t.flat()) for t in trials]
                print(json.dumps(rows, default=str, indent=2))
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
        if args.cmd == "stability-boundary":
            sb = qk.stability_boundary(
                args.id, args.width, args.group_by, args.target_width, args.tau
            )
            if args.json:
                print(json.dumps(dataclasses.asdict(sb), indent=2))
            else:
                print(stability_boundary_table(sb))
            return 0
        if args.cmd == "export":
            path = qk.export(args.id, args.out, args.format, args.metrics, args.table)
            print(f"wrote {path}", file=sys.stderr)
            return 0
        assert args.cmd == "cancel"
        print(f"study {args.id}: {qk.cancel(args.id).status}")
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
    p = sub.add_parser(
        "stability-boundary",
        help="the largest stable learning rate per width and its fit (METRICS.md section 11)",
    )
    p.add_argument("id", type=int)
    p.add_argument("--width", help="the width parameter (default model.d_model)")
    p.add_argument("--group-by", action="append", metavar="PARAM", help="repeatable")
    p.add_argument("--target-width", type=float, help="predict here (default the largest)")
    p.add_argument("--tau", type=float, help="the loss rule (default the study's, else 0.5)")
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
