"""The read-only web UI: static files served by the API process at `/ui/`.

The pages are plain ES modules (no build step) that read the same JSON API a script
reads, sending the API token as a header. The one charting library is vendored under
`static/vendor/` with its license (Apache ECharts; README.md says why), so the UI works
offline.

With API tokens configured, every route but /healthz needs one, the UI's files included.
A browser cannot add a header to the requests a page makes for its own scripts and
stylesheet, so the files take a cookie instead:

- `/ui/` (index.html) is a public shell that carries nothing but a token prompt and a few
  lines that open the UI: it POSTs the token (kept in the tab's sessionStorage) to
  `/v1/ui/session` as a bearer header, which, for a valid token, sets the cookie
  `qkscope_ui` (HttpOnly, SameSite=Strict, Path=/ui; Secure over https), then loads
  `js/app.js`;
- every other file under `/ui/` needs that cookie (or the bearer header): else 401;
- the cookie's value is an HMAC of the token's digest (`ui_cookie`): it names no token, is
  the same on every API process of a deployment, opens only the UI's files (the data routes
  take the bearer header alone, so the cookie is no CSRF ticket), and stops opening them
  once its token is removed from QKSCOPE_API_TOKENS.

Without tokens everything is served as before (the session POST answers 204, no cookie).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

__all__ = ["COOKIE", "STATIC_DIR", "UI_PATH", "may_read", "mount_ui", "ui_cookie"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
UI_PATH = "/ui"


COOKIE = "qkscope_ui"
SHELL = (".", "index.html")  # the public shell's paths under /ui/ (StaticFiles.get_path)
_PURPOSE = b"qkscope-ui-static-files"


def ui_cookie(token_digest: bytes) -> str:
    """The cookie value that opens the UI's files for the holder of a token (by digest)."""
    return hmac.new(token_digest, _PURPOSE, hashlib.sha256).hexdigest()


def may_read(scope: Scope, path: str) -> bool:
    """Whether a request for the UI file `path` (as `StaticFiles.get_path` gives it) may be
    served: no tokens configured, the shell, a valid `qkscope_ui` cookie, or a valid bearer
    header."""
    digests: list[bytes] = scope["app"].state.token_digests
    if not digests or path in SHELL:
        return True
    request = Request(scope)
    cookie = request.cookies.get(COOKIE, "")
    if cookie and any(hmac.compare_digest(cookie, ui_cookie(d)) for d in digests):
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token:
        given = hashlib.sha256(token.strip().encode()).digest()
        return any(hmac.compare_digest(given, d) for d in digests)
    return False


class _UiFiles(StaticFiles):
    """StaticFiles behind the token (see the module: the shell is public, the rest needs the
    cookie), telling the browser to revalidate (a new release shows at once) and never to
    send the page's address elsewhere."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not may_read(scope, self.get_path(scope)):
            response = PlainTextResponse(
                "the UI's files need the API token: open /ui/ and enter it",
                status_code=401,
                headers={"Cache-Control": "no-store"},
            )
            await response(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = "no-cache"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def mount_ui(app: FastAPI) -> None:
    """Serve `static/` at `/ui/` (index.html for `/ui/`). A mount, not a route: it adds no
    operation to the OpenAPI document, and `/ui` redirects to `/ui/` (the router's
    trailing-slash redirect)."""
    app.mount(UI_PATH, _UiFiles(directory=STATIC_DIR, html=True), name="ui")
