"""`qkscope`: serve the API (embedded default: SQLite + a local Ray head), submit studies,
watch them, read results, cancel, and upgrade the database."""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["main"]

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def _client(api_url: str | None = None) -> httpx.Client:
    from service.config import get_settings

    headers = {}
    if token := os.environ.get("QKSCOPE_API_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=api_url or get_settings().api_url, headers=headers, timeout=30)


def _check(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            body = r.json()
            print(f"error {r.status_code}: {body.get('message', body)}", file=sys.stderr)
            for e in body.get("errors", []):
                print(f"  {e['field']}: {e['message']}", file=sys.stderr)
        except ValueError:
            print(f"error {r.status_code}: {r.text[:500]}", file=sys.stderr)
        raise SystemExit(1)
    return r.json()


def submit(path: str, api_url: str | None = None) -> dict[str, Any]:
    text = Path(path).read_bytes()
    ctype = "application/json" if path.endswith(".json") else "application/yaml"
    with _client(api_url) as c:
        study: dict[str, Any] = _check(
            c.post("/v1/studies", content=text, headers={"content-type": ctype})
        )
    return study


def watch(study_id: int, api_url: str | None = None, poll_s: float = 1.0) -> dict[str, Any]:
    """A live progress bar until the study ends; returns the final summary."""
    from tqdm import tqdm

    with _client(api_url) as c:
        s = _check(c.get(f"/v1/studies/{study_id}/summary"))
        with tqdm(
            total=s["n_trials"], unit="trial", desc=f"study {study_id}", file=sys.stderr
        ) as bar:
            while True:
                s = _check(c.get(f"/v1/studies/{study_id}/summary"))
                bar.n = s["finished"]
                st = s["trials_by_state"]
                bar.set_postfix(status=s["status"], running=st["RUNNING"], best=s["best_value"])
                bar.refresh()
                if s["status"] in TERMINAL:
                    return dict(s)
                time.sleep(poll_s)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def results_table(
    study_id: int, api_url: str | None = None, limit: int = 50, sort: str = "value"
) -> str:
    with _client(api_url) as c:
        study = _check(c.get(f"/v1/studies/{study_id}"))
        page = _check(
            c.get(f"/v1/studies/{study_id}/trials", params={"sort": sort, "limit": limit})
        )
        summary = _check(c.get(f"/v1/studies/{study_id}/summary"))
    params = list(study["spec"].get("search_space", {}))
    cols = [
        "#",
        "state",
        "value",
        "val_loss",
        "min_H_norm",
        "rank_ratio",
        "qk_var",
        "plateau",
        "E-coll",
        "R-coll",
    ] + params
    rows = [
        [
            t["number"],
            t["state"],
            t["value"],
            t["final_val_loss"],
            t["min_norm_entropy"],
            t["final_rank_ratio"],
            t["qk_eig_var"],
            t["plateau_steps"],
            t["entropy_collapse"],
            t["rank_collapse"],
        ]
        + [t["params"].get(p) for p in params]
        for t in page["items"]
    ]
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [
        f"study {study_id} '{study['name']}': {study['status']}, "
        f"{summary['finished']}/{study['n_trials']} trials, "
        f"best value {_fmt(summary['best_value'])}",
        line,
        "-" * len(line),
    ]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    out.append(
        f"entropy-collapse rate {_fmt(summary['entropy_collapse_rate'])}, "
        f"rank-collapse rate {_fmt(summary['rank_collapse_rate'])}"
    )
    return "\n".join(out)


# service.plots.PLOT_KINDS, repeated: importing service.plots would pull in the spec (torch).
PLOT_KINDS = ("metric", "scatter", "phase", "pareto", "history")
PLOT_PARAMS = ("metric", "trials", "layer", "head", "x", "y", "color", "objective")


def _ok(r: httpx.Response) -> httpx.Response:
    """`r` if it succeeded; else the API's error printed and exit 1 (like _check)."""
    if r.status_code >= 400:
        r.read()
        _check(r)
    return r


def fetch_plot(
    study_id: int,
    kind: str,
    params: dict[str, Any],
    out: str | None = None,
    as_json: bool = False,
    api_url: str | None = None,
) -> str:
    """GET /v1/studies/<id>/plots/<kind>: the PNG written to `out` (default
    study-<id>-<kind>.png; `-` for stdout), or with `as_json` the plot's data as text."""
    query = {k: v for k, v in params.items() if v is not None}
    if as_json:
        query["format"] = "json"
    with _client(api_url) as c:
        r = _ok(c.get(f"/v1/studies/{study_id}/plots/{kind}", params=query))
    if as_json:
        return json.dumps(r.json(), indent=2)
    path = out or f"study-{study_id}-{kind}.png"
    if path == "-":
        sys.stdout.buffer.write(r.content)
        return path
    Path(path).write_bytes(r.content)
    return path


def export(
    study_id: int,
    fmt: str = "csv",
    metrics: bool = False,
    table: str | None = None,
    out: str | None = None,
    api_url: str | None = None,
) -> str:
    """GET /v1/studies/<id>/export streamed into `out` (default: the server's file name)."""
    params: dict[str, Any] = {"format": fmt, "metrics": str(metrics).lower()}
    if table:
        params["table"] = table
    with (
        _client(api_url) as c,
        c.stream("GET", f"/v1/studies/{study_id}/export", params=params) as r,
    ):
        _ok(r)
        disposition = r.headers.get("content-disposition", "")
        suggested = Path(disposition.partition('filename="')[2].rstrip('"')).name  # no dirs
        default = suggested or f"study-{study_id}.{fmt}"
        path = out or default
        with open(path, "wb") as f:
            for chunk in r.iter_bytes():
                f.write(chunk)
    return path


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app
    from service.config import get_settings
    from service.ray_cluster import LocalRayHead

    settings = get_settings()
    if not _is_loopback(args.host) and not settings.token_list():
        print(
            "refusing to serve on a non-loopback address without QKSCOPE_API_TOKENS",
            file=sys.stderr,
        )
        return 2
    head = None
    if not settings.ray_address:
        head = LocalRayHead(
            settings.home,
            dashboard_port=args.dashboard_port,
            gcs_port=args.ray_port,
            num_cpus=args.num_cpus,
        )
        print(
            f"starting a local Ray head (dashboard {head.dashboard_url}, token auth on) ...",
            file=sys.stderr,
        )
        settings.ray_address = head.start()

    def _terminate(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)  # docker stop, kill: shut Ray down cleanly too
    api_url = f"http://{args.host}:{args.port}"
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                return 1
            time.sleep(0.1)
        print(
            f"qkscope API on {api_url} (docs {api_url}/docs); Ray dashboard {settings.ray_address}",
            file=sys.stderr,
        )
        if args.run:
            study = submit(args.run, api_url)
            print(
                f"submitted study {study['id']} ({study['name']}), Ray job {study['ray_job_id']}",
                file=sys.stderr,
            )
            final = watch(study["id"], api_url)
            print(results_table(study["id"], api_url))
            if args.exit_when_done:
                return 0 if final["status"] == "COMPLETED" else 1
        thread.join()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        if head is not None:
            head.stop()


def main(argv: list[str] | None = None) -> int:
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
    p = sub.add_parser("submit", help="submit a study definition (YAML or JSON)")
    p.add_argument("file")
    p.add_argument("--watch", action="store_true")
    p = sub.add_parser("status", help="a study's progress (live bar with --watch)")
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if args.cmd == "serve":
        return serve(args)
    if args.cmd == "submit":
        study = submit(args.file)
        print(f"study {study['id']} {study['status']} (Ray job {study['ray_job_id']})")
        if args.watch:
            watch(study["id"])
        return 0
    if args.cmd == "status":
        if args.watch:
            final = watch(args.id)
            print(json.dumps(final, indent=2))
            return 0
        with _client() as c:
            print(json.dumps(_check(c.get(f"/v1/studies/{args.id}/summary")), indent=2))
        return 0
    if args.cmd == "results":
        if args.plot:
            params = {k: getattr(args, k) for k in PLOT_PARAMS}
            written = fetch_plot(args.id, args.plot, params, args.out, as_json=args.json)
            if args.json:
                print(written)
            elif written != "-":
                print(f"wrote {written}", file=sys.stderr)
            return 0
        if args.json:
            with _client() as c:
                print(
                    json.dumps(
                        _check(
                            c.get(
                                f"/v1/studies/{args.id}/trials",
                                params={"limit": args.limit, "sort": args.sort},
                            )
                        ),
                        indent=2,
                    )
                )
            return 0
        print(results_table(args.id, limit=args.limit, sort=args.sort))
        return 0
    if args.cmd == "export":
        path = export(args.id, args.format, args.metrics, args.table, args.out)
        print(f"wrote {path}", file=sys.stderr)
        return 0
    if args.cmd == "cancel":
        with _client() as c:
            s = _check(c.post(f"/v1/studies/{args.id}/cancel"))
        print(f"study {s['id']}: {s['status']}")
        return 0
    from service.config import get_settings
    from service.db import migrate

    url = get_settings().resolved_database_url()
    migrate.upgrade(url)
    print("database is at the latest schema")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
