"""A read timeout for slow clients: uvicorn's HTTP/1.1 protocol (h11) with a deadline on
reading each request.

uvicorn times out only an idle keep-alive connection between requests
(`timeout_keep_alive`); a connection that sends part of its headers, or nothing at all, or a
body one byte at a time, was held for as long as the client liked, before any route (and so
any token check) ran: 300 connections with unfinished headers stayed open for 75 s
(issue 42). Here every request must be read whole, headers and body, within
`read_timeout_s` (QKSCOPE_READ_TIMEOUT_S) of its first byte (of the connection's start, for
the first request); otherwise the connection gets `408 Request Timeout` (if no response
has started) and is closed. The time a route takes to answer is not limited: the deadline
stops once the request has been read.

`qkscope serve` uses it (`uvicorn_config`); to run the app under uvicorn yourself, pass
`--http service.http_guard:ReadTimeoutH11Protocol` (the deadline is then read from the
environment when it is imported).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.config import get_settings

__all__ = ["ReadTimeoutH11Protocol", "protocol_with_timeout", "uvicorn_config"]

_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 43\r\n\r\nthe request was not sent in time: closed.\r\n"
)
# The states of the client's side while its request is still being read (h11): waiting for
# (the rest of) the headers, or for the rest of the body.
_READING = (h11.IDLE, h11.SEND_BODY)


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on reading each request (see the module)."""

    read_timeout_s: float = get_settings().read_timeout_s

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that sends nothing is a request not sent in time

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in _READING:
            self._arm()  # (the rest of) a request: its deadline runs from its first byte
        else:
            self._disarm()  # read whole (or the connection is closing): the route's time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Between requests uvicorn's keep-alive timeout applies; the next request's first
        # byte arms the deadline again.
        self._disarm()

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in _READING:
            return
        if self.conn.our_state == h11.IDLE:  # no response to this request has begun
            self.transport.write(_TIMEOUT)
        self.transport.close()  # a route still reading the body hears a disconnect


def protocol_with_timeout(read_timeout_s: float) -> type[ReadTimeoutH11Protocol]:
    """The protocol class with its own deadline (a setting read at start)."""
    return type(
        "ReadTimeoutH11Protocol", (ReadTimeoutH11Protocol,), {"read_timeout_s": read_timeout_s}
    )


def uvicorn_config(app: Any, read_timeout_s: float, **kwargs: Any) -> Any:
    """uvicorn's Config for `app` with the guarded protocol (`kwargs`: host, port, ...)."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_with_timeout(read_timeout_s), **kwargs)
