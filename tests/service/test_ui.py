"""The web UI at /ui/, used as a person would: headless Chromium (the OS package, driven by
Playwright) against the real app served by uvicorn on a real SQLite database holding a finished
quickstart-like study and a running one (tests/service/ui_seed.py: the ingest path).

Outside CI a missing Chromium or Playwright skips these tests; under CI=true it fails them
(.ci/run installs Chromium). Set QKSCOPE_UI_SCREENSHOTS=DIR to keep a screenshot of each page
(docs/ui/*.png are made this way).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db import migrate
from service.db.models import Metric
from service.db.session import make_engine
from tests.service import ui_seed
from tests.service.conftest import live_api

CHROMIUM = os.environ.get("QKSCOPE_CHROMIUM", "/usr/bin/chromium")
TOKEN = "ui-test-token"
WAIT_MS = 15_000  # the pages poll every 2.5-3 s
COLLAPSED_COLOR = "#d62728"


def _browser_problem() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    problem = _browser_problem()
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser tests need Chromium under CI=true: {problem}")
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    exe = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine, ui_seed.Seeded]]:
    url = f"sqlite:///{tmp_path_factory.mktemp('uidb') / 'qkscope.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        yield url, engine, ui_seed.seed(engine)
    finally:
        engine.dispose()


def _serve(url: str, home: Path, tokens: str) -> Iterator[str]:
    settings = Settings(
        database_url=url, ray_address="http://127.0.0.1:8265", api_tokens=tokens, home=home
    )
    with pytest.MonkeyPatch.context() as mp, live_api(settings, mp) as base:
        yield base


@pytest.fixture(scope="module")
def site(
    db: tuple[str, Engine, ui_seed.Seeded], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The app without tokens (the embedded default)."""
    yield from _serve(db[0], tmp_path_factory.mktemp("home"), "")


@pytest.fixture(scope="module")
def secured_site(
    db: tuple[str, Engine, ui_seed.Seeded], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The same database served with API tokens configured."""
    yield from _serve(db[0], tmp_path_factory.mktemp("home"), TOKEN)


class Page:
    """A browser page that records console errors, failed requests and request URLs."""

    def __init__(self, browser: Any, base: str) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: self.urls.append(r.url))

    def open(self, hash_: str, ready: str | None) -> Any:
        self.page.goto(f"{self.base}/ui/{hash_}")
        if ready:
            self.page.wait_for_selector(
                f"html[data-ready{ready}]", state="attached", timeout=WAIT_MS
            )
        return self.page

    def shot(self, name: str) -> None:
        out = os.environ.get("QKSCOPE_UI_SCREENSHOTS")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            self.page.wait_for_timeout(1500)  # let the charts settle
            self.page.screenshot(path=str(Path(out) / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, site: str) -> Iterator[Page]:
    p = Page(browser, site)
    yield p
    p.close()


def api(base: str, path: str, **params: Any) -> Any:
    r = httpx.get(f"{base}{path}", params=params, timeout=30)
    r.raise_for_status()
    return r.json()


def numbers_shown(p: Any) -> list[int]:
    return [
        int(n)
        for n in p.eval_on_selector_all(
            "#trials-body tr[data-number]", "rs => rs.map(r => r.dataset.number)"
        )
    ]


def wait_numbers(p: Any, expected: list[int]) -> None:
    p.wait_for_function(
        "exp => JSON.stringify([...document.querySelectorAll('#trials-body tr[data-number]')]"
        ".map(r => Number(r.dataset.number))) === JSON.stringify(exp)",
        arg=expected,
        timeout=WAIT_MS,
    )


def test_every_page_loads_without_console_errors(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    seeded = db[2]
    p = page.open("#/", "studies")
    rows = p.eval_on_selector_all(
        "#studies-body tr[data-study]", "rs => rs.map(r => r.dataset.study)"
    )
    assert sorted(map(int, rows)) == sorted([seeded.finished_id, seeded.running_id])
    job = p.get_attribute(f"tr[data-study='{seeded.finished_id}'] td:last-child a", "href")
    assert job == f"http://127.0.0.1:8265/#/jobs/qkscope-study-{seeded.finished_id}-a1-000000"
    assert "13%" in p.inner_text(f"tr[data-study='{seeded.finished_id}']")  # entropy collapse
    page.shot("studies")

    page.open(f"#/studies/{seeded.finished_id}", "study")
    p.wait_for_selector("html[data-readystudycharts]", state="attached", timeout=WAIT_MS)
    assert p.inner_text("#card-progress").strip().endswith("8/8")
    page.shot("study")

    tid = seeded.trial_ids[0]
    page.open(f"#/trials/{tid}", "trial")
    assert "trapped" in p.inner_text(f"#trial-{tid} .trial-head")
    page.shot("trial")

    pair = f"{seeded.trial_ids[0]},{seeded.trial_ids[5]}"
    p.evaluate("() => { delete document.documentElement.dataset.readytrial; }")
    page.open(f"#/trials/{pair}", "trial")
    assert p.locator(".trial-col").count() == 2
    page.shot("compare")
    assert page.errors == [], page.errors


def test_trial_table_sorts_and_filters_as_the_api_says(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    sid = db[2].finished_id
    p = page.open(f"#/studies/{sid}", "study")
    path = f"/v1/studies/{sid}/trials"
    assert numbers_shown(p) == list(range(8))

    def expected(**params: Any) -> list[int]:
        return [t["number"] for t in api(site, path, **params)["items"]]

    p.click("#trials th[data-sort='min_norm_entropy']")
    wait_numbers(p, expected(sort="min_norm_entropy"))
    p.click("#trials th[data-sort='min_norm_entropy']")
    wait_numbers(p, expected(sort="-min_norm_entropy"))
    p.click("#trials th[data-sort='params.regularizer.lambda']")
    wait_numbers(p, expected(sort="params.regularizer.lambda"))

    p.fill("#where", "min_norm_entropy>=0.5; params.model.qk_init_std<1")
    p.click("#filters button[type=submit]")
    want = expected(
        sort="params.regularizer.lambda",
        where=["min_norm_entropy>=0.5", "params.model.qk_init_std<1"],
    )
    assert 0 < len(want) < 8
    wait_numbers(p, want)
    assert p.inner_text("#trials-info") == f"1-{len(want)} of {len(want)}"

    p.fill("#where", "entropy_collapse=1")
    p.click("#filters button[type=submit]")
    wait_numbers(p, [0])

    p.fill("#where", "nonsense>=1")  # the API's 422 message, shown where the filter is
    p.click("#filters button[type=submit]")
    p.wait_for_function(
        "() => document.querySelector('#trials-error').textContent.includes('unknown field')",
        timeout=WAIT_MS,
    )
    # The browser logs the 422 of that request itself; the page raised nothing.
    assert [e for e in page.errors if "status of 422" not in e] == [], page.errors


def test_heatmap_has_one_cell_per_stored_row_and_shows_the_collapsed_head(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    _, engine, seeded = db
    number, layer, head = ui_seed.COLLAPSED
    tid = seeded.trial_ids[number]
    with Session(engine) as s:
        stored = s.execute(
            select(Metric.layer, Metric.head, Metric.step, Metric.value).where(
                Metric.trial_id == tid, Metric.name == "attn_entropy_norm"
            )
        ).all()
    p = page.open(f"#/trials/{tid}", "trial")
    drawn = p.evaluate(
        """id => {
        const c = window.qkCharts.get(id), o = c.getOption(), d = c.getModel().getSeriesByIndex(0).getData();
        return {
          rows: o.yAxis[0].data, steps: o.xAxis[0].data,
          cells: o.series[0].data.map((v, i) => [v[0], v[1], v[2], d.getItemVisual(i, 'style').fill]),
        };
    }""",
        f"heatmap-{tid}",
    )
    cells = {
        (drawn["rows"][y], int(drawn["steps"][x])): (value, color)
        for x, y, value, color in drawn["cells"]
    }
    assert len(drawn["cells"]) == len(stored) == len(cells)  # one cell per row, no duplicates
    threshold = 0.1  # quickstart: base.entropy_collapse_threshold
    below = set()
    for lay, hd, step, value in stored:
        shown, color = cells[(f"L{lay} H{hd}", step)]
        assert shown == pytest.approx(value)
        assert (color.lower() == COLLAPSED_COLOR) == (value < threshold), (
            lay,
            hd,
            step,
            value,
            color,
        )
        if value < threshold:
            below.add((lay, hd, step))
    assert below == {(layer, head, s) for s in ui_seed.STEPS if s >= ui_seed.COLLAPSE_FROM}
    assert p.get_attribute(f"#heatmap-{tid}", "data-collapsed") == f"L{layer} H{head}"
    note = p.inner_text(f"#collapsed-{tid}")
    assert f"L{layer} H{head} (from step {ui_seed.COLLAPSE_FROM}" in note and "0.1" in note
    assert page.errors == [], page.errors


def test_a_running_study_and_trial_update_without_reload(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    _, engine, seeded = db
    sid = seeded.running_id
    p = page.open(f"#/studies/{sid}", "study")
    assert numbers_shown(p) == [0, 1]
    assert "2 running" in p.inner_text("#card-states")
    ui_seed.add_trial(engine, sid, 2, "RUNNING", ui_seed.STEPS[:1])  # the runner's next trial
    wait_numbers(p, [0, 1, 2])
    p.wait_for_function(
        "() => document.querySelector('#card-states').textContent.includes('3 running')",
        timeout=WAIT_MS,
    )

    tid = seeded.running_trial_ids[0]
    page.open(f"#/trials/{tid}", "trial")
    cells = f"() => document.getElementById('heatmap-{tid}').dataset.cells"
    assert p.evaluate(cells) == str(2 * len(ui_seed.LAYERS) * len(ui_seed.HEADS))
    ui_seed.add_metrics(engine, tid, 0, ui_seed.STEPS[2:4])  # two more evaluations arrive
    p.wait_for_function(
        f"() => ({cells})() === '{4 * len(ui_seed.LAYERS) * len(ui_seed.HEADS)}'", timeout=WAIT_MS
    )
    assert page.errors == [], page.errors


def test_with_tokens_no_data_without_a_valid_token(
    browser: Any, secured_site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    seeded = db[2]
    # The assets need no token; every data route does.
    assert httpx.get(f"{secured_site}/ui/").status_code == 200
    assert httpx.get(f"{secured_site}/v1/ui/config").status_code == 401
    page = Page(browser, secured_site)
    try:
        p = page.open(f"#/studies/{seeded.finished_id}", None)
        p.wait_for_selector(".token-form", timeout=WAIT_MS)
        assert "No token given: no data is shown." in p.inner_text("#auth-message")
        assert p.locator("#trials, #studies, .trial-col").count() == 0

        p.fill("#token", "wrong-token")
        p.click(".token-form button[type=submit]")
        p.wait_for_function(
            "() => document.querySelector('#auth-message')?.textContent.includes('not accepted')",
            timeout=WAIT_MS,
        )
        assert p.locator("#trials, #studies, .trial-col").count() == 0
        assert "quickstart" not in p.inner_text("main")

        p.fill("#token", TOKEN)
        p.click(".token-form button[type=submit]")
        p.wait_for_selector("html[data-readystudy]", state="attached", timeout=WAIT_MS)
        assert numbers_shown(p) == list(range(8))
        # Kept for the tab (a reload needs no new prompt), never put in an address.
        assert p.evaluate("() => sessionStorage.getItem('qkscope.token')") == TOKEN
        p.reload()
        p.wait_for_selector("html[data-readystudy]", state="attached", timeout=WAIT_MS)
        assert not [u for u in page.urls if TOKEN in u or "wrong-token" in u]
        # 401s of the rejected calls are logged by the browser as failed resources; nothing else.
        assert all(re.search(r"status of 401", e) for e in page.errors), page.errors
    finally:
        page.close()


def test_the_series_route_groups_what_metrics_returns(
    site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """What the heatmap reads: /series is /metrics regrouped (same rows, same order)."""
    tid = db[2].trial_ids[0]
    rows = api(site, f"/v1/trials/{tid}/metrics")
    grouped = api(site, f"/v1/trials/{tid}/series")
    assert grouped["rows"] == len(rows) and not grouped["truncated"]
    flat = [
        {"name": s["name"], "layer": s["layer"], "head": s["head"], "step": st, "value": v}
        for s in grouped["series"]
        for st, v in zip(s["steps"], s["values"], strict=True)
    ]
    assert flat == rows
    one = api(site, f"/v1/trials/{tid}/series", name="rank_ratio", step_min=100, step_max=200)
    assert [(s["layer"], s["steps"]) for s in one["series"]] == [
        (ly, [100, 150, 200]) for ly in (0, 1, 2)
    ]
    assert httpx.get(f"{site}/v1/trials/999999/series").status_code == 404
    r = httpx.get(f"{site}/v1/trials/{tid}/series", params={"step_min": 5, "step_max": 1})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "step_min"
    assert api(site, f"/v1/trials/{tid}/series", limit=10)["truncated"] is True
    with Session(db[1]) as s:
        assert s.scalar(
            select(func.count()).select_from(Metric).where(Metric.trial_id == tid)
        ) == len(rows)
