"""Issue 32, item 3: POST /v1/studies submitted the Ray job on the event loop, so `/healthz`
took 4.5 s during a 5 s submit (the compose healthcheck gives up at 3 s). Now the submit runs
in a worker thread: `/healthz` and reads answer while a submit is slow.

Ray's job server here is a real HTTP server on loopback that answers the version check and
sleeps on the submission (a slow server, not a mock of Ray's client: the API talks to it
through Ray's own JobSubmissionClient). The bound on `/healthz` is generous (1 s against a
5 s submit): a correctness test of not blocking, not a timing test."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.store.models import Study
from service.store.session import make_engine
from tests.service.conftest import live_api

SUBMIT_S = 5.0
BOUND_S = 1.0
VALID = {"name": "slow-submit", "budget": {"n_trials": 2}}


class SlowJobServer:
    """Ray's job server, slow to accept a submission: `/api/version` at once, `POST
    /api/jobs/` after `delay_s`; records what the database held when the submission came."""

    def __init__(self, db_url: str, delay_s: float) -> None:
        self.received = threading.Event()
        self.answered = threading.Event()
        self.rows_at_submit: list[tuple[str, str | None]] = []
        self.submission_id = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.startswith("/api/version"):
                    self._json(200, {"version": "4", "ray_version": "2.50.0", "ray_commit": "x"})
                else:
                    self._json(404, {})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.startswith("/api/jobs"):
                    self._json(404, {})
                    return
                outer.submission_id = body.get("submission_id", "")
                engine = make_engine(db_url)  # what is committed when the submission arrives
                try:
                    with Session(engine) as s:
                        outer.rows_at_submit = [
                            (r.status, r.ray_job_id) for r in s.scalars(select(Study))
                        ]
                finally:
                    engine.dispose()
                outer.received.set()
                time.sleep(delay_s)
                outer.answered.set()
                self._json(200, {"submission_id": outer.submission_id, "job_id": None})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> SlowJobServer:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_ray(db_url: str) -> Iterator[SlowJobServer]:
    with SlowJobServer(db_url, SUBMIT_S) as server:
        yield server


def _get(url: str) -> tuple[int, float]:
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()
        return r.status, time.monotonic() - t0


def test_healthz_and_reads_answer_while_a_submit_is_slow(
    db_url: str, slow_ray: SlowJobServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(database_url=db_url, ray_address=slow_ray.url, api_tokens="", home=tmp_path)
    with live_api(settings, monkeypatch) as url:
        posted: dict[str, Any] = {}

        def post() -> None:
            req = urllib.request.Request(
                f"{url}/v1/studies",
                data=json.dumps(VALID).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=60) as r:
                posted.update(status=r.status, body=json.loads(r.read()))
            posted["s"] = time.monotonic() - t0

        thread = threading.Thread(target=post)
        thread.start()
        assert slow_ray.received.wait(60), "the submission never reached the job server"
        health, reads = [], []
        for _ in range(4):
            health.append(_get(f"{url}/healthz"))
            reads.append(_get(f"{url}/v1/studies"))
        during = not slow_ray.answered.is_set()
        thread.join(60)
    assert all(code == 200 for code, _ in health + reads)
    assert max(s for _, s in health) < BOUND_S, health
    assert max(s for _, s in reads) < BOUND_S, reads
    assert during, "measured after the submit, not during it"
    # The row was committed PENDING, with the job id, before the submission went out.
    assert slow_ray.rows_at_submit == [("PENDING", slow_ray.submission_id)]
    assert posted["status"] == 201 and posted["body"]["ray_job_id"] == slow_ray.submission_id
    assert posted["s"] >= SUBMIT_S * 0.9, posted  # the POST itself did wait for the submit
