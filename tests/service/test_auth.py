"""Bearer-token auth on every route of the app's route table (real databases, no mocks)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings

TOKENS = ("tok-a", "tok-b")
PUBLIC = {"/healthz"}
# Static files served without a token: the web UI's pages and scripts carry no data and no
# secrets; every data route they call is in the route table below and needs the token.
PUBLIC_MOUNTS = {"/ui"}
# Not in the schema, behind the token too: the docs, and the web UI's cookie for its files.
DOCS = {
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("POST", "/v1/ui/session"),
    ("DELETE", "/v1/ui/session"),
}
SPEC = {"name": "auth-study", "budget": {"n_trials": 2}}


def routes(app: FastAPI) -> list[tuple[str, str, bool]]:
    """(method, path, in_schema) for every endpoint, including routes of included routers."""
    out: list[tuple[str, str, bool]] = []

    def walk(items: list[Any]) -> None:
        for r in items:
            nested = getattr(r, "effective_candidates", None)
            if callable(nested):
                walk(nested())
            elif getattr(r, "methods", None) and getattr(r, "path", None):
                for m in sorted(r.methods - {"HEAD"}):
                    out.append((m, r.path, bool(getattr(r, "include_in_schema", True))))

    walk(list(app.routes))
    return sorted(set(out))


def fill(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


@pytest.fixture
def secured(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[FastAPI, TestClient, str]]:
    ray_token = secrets.token_hex(24)
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_token)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    settings = Settings(
        database_url=db_url, ray_address="", api_tokens=",".join(TOKENS), home=tmp_path
    )
    app = create_app(settings, reconcile_loop=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield app, c, ray_token


def call(c: TestClient, method: str, path: str, headers: dict[str, str]) -> Any:
    if method == "POST" and path == "/v1/studies":
        return c.post(
            path,
            content=json.dumps(SPEC).encode(),
            headers={"content-type": "application/json", **headers},
        )
    return c.request(method, path, headers=headers)


def test_every_api_route_needs_a_valid_token(secured: tuple[FastAPI, TestClient, str]) -> None:
    app, c, ray_token = secured
    table = routes(app)
    api = [(m, p) for m, p, in_schema in table if in_schema and p not in PUBLIC]
    # The walk must see every operation the OpenAPI document lists.
    openapi = c.get("/openapi.json", headers={"Authorization": "Bearer tok-b"}).json()["paths"]
    documented = {(m.upper(), p) for p, ops in openapi.items() for m in ops}
    assert documented == {(m, p) for m, p, s in table if s}
    assert {(m, p) for m, p, s in table if not s} == DOCS
    api += sorted(DOCS)
    known = {
        ("POST", "/v1/studies"),
        ("GET", "/v1/studies"),
        ("GET", "/v1/studies/{study_id}"),
        ("POST", "/v1/studies/{study_id}/cancel"),
        ("GET", "/v1/studies/{study_id}/trials"),
        ("GET", "/v1/studies/{study_id}/summary"),
        ("GET", "/v1/studies/{study_id}/best"),
        ("GET", "/v1/trials/{trial_id}"),
        ("GET", "/v1/trials/{trial_id}/metrics"),
        ("GET", "/v1/spec-schema"),
    }
    assert known <= set(api), known - set(api)

    bodies: list[str] = []
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic dG9rLWE6"},
        {"Authorization": "tok-a"},
        {"Authorization": "Bearer tok-a,tok-b"},
        {"Authorization": "Bearer TOK-A"},
        {"Authorization": f"Bearer {ray_token}"},
    ]
    for method, path in api:
        url = fill(path)
        for h in bad_headers:
            r = call(c, method, url, h)
            assert r.status_code == 401, (method, url, h, r.status_code)
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["error"] == "unauthorized" and r.json()["message"]
            assert r.headers.get("www-authenticate") == "Bearer"
            bodies.append(r.text)
    # Nothing was written by the rejected POSTs.
    assert c.get("/v1/studies", headers={"Authorization": "Bearer tok-a"}).json()["total"] == 0

    # Create study 1 first so that the {id}=1 routes find something.
    expected = {
        "POST /v1/studies": 201,
        "GET /v1/trials/{trial_id}": 404,
        "GET /v1/trials/{trial_id}/metrics": 404,
    }  # no trial 1: the study never ran
    order = sorted(api, key=lambda mp: (mp != ("POST", "/v1/studies"), mp))
    for i, (method, path) in enumerate(order):
        url = fill(path)
        token = TOKENS[i % 2]
        r = call(c, method, url, {"Authorization": f"Bearer {token}"})
        if (method, path) in known:
            assert r.status_code == expected.get(f"{method} {path}", 200), (method, url, r.text)
        else:  # a route added after this test was written: authorised, and no server error
            assert r.status_code not in (401, 403) and r.status_code < 500, (method, url, r.text)
        bodies.append(r.text)
        r = call(c, method, url, {"Authorization": f"bearer  {TOKENS[1 - i % 2]} "})
        assert r.status_code not in (401, 500), (method, url, r.text)
        bodies.append(r.text)

    for path in PUBLIC:
        r = c.get(path)
        assert r.status_code == 200, path
        bodies.append(r.text)
    assert c.get("/healthz").json()["status"] == "ok"
    assert c.get("/healthz", headers={"Authorization": "Bearer wrong"}).status_code == 200

    leaked = [b[:200] for b in bodies if ray_token in b]
    assert not leaked, leaked
    assert len(bodies) > 100


def test_no_tokens_configured_means_open(db_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=db_url, ray_address="", api_tokens=" , ", home=tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False)) as c:
        assert c.get("/v1/studies").status_code == 200
        assert c.get("/v1/studies", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_the_web_ui_shell_is_the_only_public_file(
    secured: tuple[FastAPI, TestClient, str],
) -> None:
    """The one mount of the app is the web UI's static directory: its shell (index.html: a
    token prompt, no data) loads without a token; its other files need the token (issue 42:
    the bearer header, or the cookie /v1/ui/session sets, tests/service/test_ui_auth.py),
    and the routes the pages read answer 401 without one."""
    from starlette.routing import Mount

    app, c, ray_token = secured
    mounts = {r.path for r in app.routes if isinstance(r, Mount)}
    assert mounts == PUBLIC_MOUNTS
    for path in ("/ui/", "/ui/index.html"):
        r = c.get(path)
        assert r.status_code == 200, path
        assert "tok-a" not in r.text and "study" not in r.headers.get("content-type", "")
    for path in ("/ui/js/app.js", "/ui/vendor/echarts.LICENSE", "/ui/style.css"):
        assert c.get(path).status_code == 401, path
        r = c.get(path, headers={"Authorization": f"Bearer {TOKENS[0]}"})
        assert r.status_code == 200, path
        assert ray_token not in r.text
    r = c.get("/ui", follow_redirects=False)
    assert r.status_code in (307, 308) and r.headers["location"].endswith("/ui/")
    for path in ("/ui/../v1/studies", "/ui/%2e%2e/v1/studies", "/ui/nope.js"):
        r = c.get(path)
        assert r.status_code in (401, 404), (path, r.status_code)
        assert "items" not in r.text
    for path in ("/v1/ui/config", "/v1/trials/1/series", "/v1/studies"):
        assert c.get(path).status_code == 401, path
