"""The read-only web UI: static files served by the API process at `/ui/`.

The pages are plain ES modules (no build step) that read the same JSON API a script
reads, sending the API token as a header; the files themselves carry no data and no
secrets, so they are served without a token (the data routes they call still need it).
The one charting library is vendored under `static/vendor/` with its license (Apache
ECharts; README.md says why), so the UI works offline.
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

__all__ = ["STATIC_DIR", "UI_PATH", "mount_ui"]

STATIC_DIR = Path(__file__).resolve().parent / "static"
UI_PATH = "/ui"


class _UiFiles(StaticFiles):
    """StaticFiles that tells the browser to revalidate (a new release shows at once) and
    never to send the page's address elsewhere."""

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
