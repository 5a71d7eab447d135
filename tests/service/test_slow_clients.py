"""Issue 42: a read timeout for slow clients, with real sockets against uvicorn.

Connections that send part of their headers (or nothing, or a body byte by byte) were held
open as long as the client liked, before any route or token check ran: 300 of them stayed
open for 75 s. `qkscope serve` runs uvicorn with `service/http_guard.py`: each request must
be read whole within QKSCOPE_READ_TIMEOUT_S, else 408 and closed. A request read in time is
answered however long the route takes, and keep-alive still works.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.http_guard import uvicorn_config
from tests.conftest import free_port

TIMEOUT_S = 1.0


@contextlib.contextmanager
def _serving(app: Any, guarded: bool = True) -> Iterator[int]:
    import uvicorn

    port = free_port()
    kw: dict[str, Any] = {"host": "127.0.0.1", "port": port, "log_level": "warning"}
    config = uvicorn_config(app, TIMEOUT_S, **kw) if guarded else uvicorn.Config(app, **kw)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def _open(port: int, first: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if first:
        s.sendall(first)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after `seconds`."""
    s.settimeout(seconds)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


PARTIAL = b"GET /v1/studies HTTP/1.1\r\nHost: x\r\nX-Slow: "  # never the blank line


@pytest.fixture
def app(tmp_path: Path) -> Any:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'q.db'}", api_tokens="tok", home=tmp_path
    )
    return create_app(settings, reconcile_loop=False)


def test_unfinished_requests_are_closed_with_a_408(app: Any) -> None:
    """Many connections: unfinished headers, nothing at all, and a body that stops short."""
    with _serving(app) as port:
        body = b"POST /v1/studies HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
        socks = [_open(port, PARTIAL) for _ in range(40)]
        socks += [_open(port, b"") for _ in range(10)]
        socks += [_open(port, body) for _ in range(10)]
        t0 = time.monotonic()
        answers = [_closed_within(s, 10 * TIMEOUT_S) for s in socks]
        waited = time.monotonic() - t0
        for s in socks:
            s.close()
        assert all(a is not None for a in answers), "a connection was still open"
        assert waited < 8 * TIMEOUT_S
        assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers[:50])
        # The body that stopped short: the route began reading it (the token check comes
        # first: a 401 may already be on its way), then the connection is closed.
        assert all(a is not None for a in answers[50:])
        # The server still answers others.
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert r.status_code == 200


def test_without_the_guard_they_stay_open(app: Any) -> None:
    """The control: uvicorn's own config (what `serve` ran before) keeps them open."""
    with _serving(app, guarded=False) as port:
        socks = [_open(port, PARTIAL) for _ in range(5)]
        try:
            assert all(_closed_within(s, 3 * TIMEOUT_S) is None for s in socks)
        finally:
            for s in socks:
                s.close()


def test_a_request_read_in_time_is_answered_however_long_the_route_takes() -> None:
    """The deadline covers reading the request only: a route slower than it still answers,
    a request trickled in under the deadline is served, and keep-alive serves a second
    request on the same connection."""

    async def slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        await asyncio.sleep(3 * TIMEOUT_S)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    with _serving(slow_app) as port:
        s = _open(port, b"GET / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(TIMEOUT_S / 3)
        s.sendall(b"\r\n")  # the headers end within the deadline
        s.settimeout(20)
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200") and b"done" in first, first
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: a second request
        second = s.recv(4096)
        assert second.startswith(b"HTTP/1.1 200"), second
        s.close()
