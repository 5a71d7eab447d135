"""Issue 42: with API tokens configured, the web UI's files need the token too, and the page
still opens (the browser flow is tests/service/test_ui.py's; here the HTTP contract).

`/ui/` is a public shell with no data; `POST /v1/ui/session` with a valid bearer token sets
the `qkscope_ui` cookie, which (or the bearer header itself) opens the other files under
`/ui/`; without tokens nothing changes. Before: every file under /ui/ was served to anyone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings

TOKENS = "first-token,second-token"
FILES = ["js/app.js", "js/api.js", "style.css", "vendor/echarts.esm.min.js", "js/trial.js"]


def _client(tmp_path: Path, tokens: str) -> TestClient:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'q.db'}", api_tokens=tokens, home=tmp_path
    )
    return TestClient(create_app(settings, reconcile_loop=False))


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[TestClient]:
    with _client(tmp_path, TOKENS) as c:
        yield c


def test_with_tokens_the_files_need_the_cookie_and_the_shell_carries_nothing(
    secured: TestClient,
) -> None:
    shell = secured.get("/ui/")
    assert shell.status_code == 200 and "token" in shell.text
    assert secured.get("/ui/index.html").status_code == 200
    for f in FILES:
        r = secured.get(f"/ui/{f}")
        assert r.status_code == 401, (f, r.status_code)
        assert "function" not in r.text and "echarts" not in r.text.lower()
    assert secured.post("/v1/ui/session").status_code == 401  # no token, no cookie
    bad = secured.post("/v1/ui/session", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and "qkscope_ui" not in bad.headers.get("set-cookie", "")
    assert secured.get("/ui/js/app.js").status_code == 401

    ok = secured.post("/v1/ui/session", headers={"Authorization": "Bearer second-token"})
    assert ok.status_code == 204
    cookie = ok.headers["set-cookie"]
    assert "qkscope_ui=" in cookie and "second-token" not in cookie
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    for f in FILES:  # the TestClient keeps the cookie, as a browser does
        assert secured.get(f"/ui/{f}").status_code == 200, f
    # The cookie opens no data route: those take the bearer header alone.
    assert secured.get("/v1/studies").status_code == 401
    assert secured.get("/v1/ui/config").status_code == 401


def test_a_forged_or_stale_cookie_opens_nothing(secured: TestClient, tmp_path: Path) -> None:
    secured.cookies.set("qkscope_ui", "0" * 64, path="/ui")
    assert secured.get("/ui/js/app.js").status_code == 401
    secured.cookies.clear()
    ok = secured.post("/v1/ui/session", headers={"Authorization": "Bearer first-token"})
    value = ok.cookies["qkscope_ui"]
    # The same token on another API process of the deployment: the same cookie works.
    home = tmp_path / "other"
    home.mkdir()
    with _client(home, TOKENS) as other:
        other.cookies.set("qkscope_ui", value, path="/ui")
        assert other.get("/ui/js/app.js").status_code == 200
    # Its token revoked (the API restarted without it): the cookie opens nothing.
    home2 = tmp_path / "revoked"
    home2.mkdir()
    with _client(home2, "second-token") as revoked:
        revoked.cookies.set("qkscope_ui", value, path="/ui")
        assert revoked.get("/ui/js/app.js").status_code == 401
    # The bearer header opens a file too (a script fetching the UI).
    auth = {"Authorization": "Bearer first-token"}
    assert secured.get("/ui/js/app.js", headers=auth).status_code == 200
    # Forgetting: the cookie is deleted.
    secured.cookies.set("qkscope_ui", value, path="/ui")
    out = secured.delete("/v1/ui/session", headers=auth)
    assert out.status_code == 204 and "qkscope_ui=" in out.headers["set-cookie"]
    assert "Max-Age=0" in out.headers["set-cookie"]


def test_without_tokens_the_ui_is_served_as_before(tmp_path: Path) -> None:
    with _client(tmp_path, "") as c:
        for f in ["", *FILES]:
            assert c.get(f"/ui/{f}").status_code == 200, f
        r = c.post("/v1/ui/session")
        assert r.status_code == 204 and "set-cookie" not in r.headers
