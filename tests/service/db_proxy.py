"""A TCP proxy in front of the test PostgreSQL that can cut the database off: every open
connection closed and new ones refused (nothing listens on its port), for as long as a test
wants, as a PostgreSQL restart or a failover does. Real sockets, a real server behind."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit, urlunsplit

__all__ = ["CuttableProxy"]


class CuttableProxy:
    """127.0.0.1:<port> forwarding to `target`; `cut()` / `restore()` / `cut_for(s)`."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self._parts = parts
        self.target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._server: socket.socket | None = None
        self.port = 0
        self.cuts = 0
        self._listen()

    @property
    def url(self) -> str:
        """The target's URL with the proxy as its host and port."""
        p = self._parts
        auth = p.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))

    @property
    def is_cut(self) -> bool:
        return self._server is None

    # ---- the switch ---------------------------------------------------------------------

    def cut(self) -> None:
        """Close every forwarded connection and stop listening: connects are refused."""
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, set()
            self.cuts += 1
        if server is not None:
            _close(server)
        for c in conns:
            _close(c)

    def restore(self) -> None:
        """Listen again on the same port."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self._listen()
                return
            except OSError:  # the old socket is still closing
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def cut_for(self, seconds: float) -> threading.Thread:
        """Cut now, restore after `seconds` (in a thread, returned)."""
        self.cut()

        def later() -> None:
            time.sleep(seconds)
            self.restore()

        t = threading.Thread(target=later, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.cut()

    # ---- forwarding ---------------------------------------------------------------------

    def _listen(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        self.port = srv.getsockname()[1]
        with self._lock:
            self._server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._server is not srv:  # cut while connecting
                    _close(client)
                    _close(upstream)
                    return
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
