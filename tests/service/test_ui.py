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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from service.config import Settings
from service.store import migrate
from service.store.models import Metric, Trial
from service.store.session import make_engine
from tests.conftest import free_port
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


class Server:
    """The app on a given port, stoppable: a restart with other tokens is how an operator
    revokes one (QKSCOPE_API_TOKENS is read at start)."""

    def __init__(self, url: str, home: Path, tokens: str, port: int) -> None:
        import uvicorn

        from service.app import create_app

        settings = Settings(
            database_url=url, ray_address="http://127.0.0.1:8265", api_tokens=tokens, home=home
        )
        self.base = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(
            create_app(settings, reconcile_loop=False),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


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
    listed = [st["id"] for st in api(page.base, "/v1/studies", limit=100)["items"]]
    assert {seeded.finished_id, seeded.running_id, seeded.pareto_id} <= set(listed)
    assert sorted(map(int, rows)) == sorted(listed)
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


def test_logit_heatmap_beside_the_entropy_has_one_cell_per_stored_row(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """attn_logit_max (METRICS.md 9) as a layer x head heatmap beside the entropy's: one
    cell per stored row with its value, colours rising with the value (the growing head's
    last cells in the top band), and the largest logit named under it."""
    _, engine, seeded = db
    number, layer, head = ui_seed.COLLAPSED
    tid = seeded.trial_ids[number]
    with Session(engine) as s:
        stored = s.execute(
            select(Metric.layer, Metric.head, Metric.step, Metric.value).where(
                Metric.trial_id == tid, Metric.name == "attn_logit_max"
            )
        ).all()
    assert stored
    p = page.open(f"#/trials/{tid}", "trial")
    heat = f"window.qkCharts.get('logitmap-{tid}')"
    p.wait_for_function(f"() => {heat} && {heat}.cells().length > 0", timeout=WAIT_MS)
    drawn = p.evaluate(f"() => {heat}.cells()")
    cells = {(label, step): (value, color) for label, step, value, color in drawn}
    assert len(drawn) == len(stored) == len(cells)
    top = max(v for *_, v in stored)
    ramp = p.evaluate("async () => (await import('./js/heatmap.js')).HEAT_RAMP")
    for lay, hd, step, value in stored:
        shown, color = cells[(f"L{lay} H{hd}", step)]
        assert shown == value
        band = min(len(ramp) - 1, int(value / (top / len(ramp))))
        assert color.lower() == ramp[band], (lay, hd, step, value, color)
    last = cells[(f"L{layer} H{head}", ui_seed.STEPS[-1])]
    assert last[1].lower() == ramp[-1]
    # beside the entropy heatmap, in the same row of the page
    boxes = [p.locator(f"#{k}-{tid}").bounding_box() for k in ("heatmap", "logitmap")]
    assert boxes[0] is not None and boxes[1] is not None
    assert abs(boxes[0]["y"] - boxes[1]["y"]) < 2 and boxes[1]["x"] > boxes[0]["x"]
    assert f"{top:.3g}"[:3] in p.inner_text(f"#logitmax-{tid}").replace(",", "")
    assert page.errors == []


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
    # The heatmap is one canvas image with a pixel per stored row; cells() reads those
    # pixels back, pixelAt() the scaled chart on screen.
    heat = f"window.qkCharts.get('heatmap-{tid}')"
    drawn = p.evaluate(f"() => {heat}.cells()")
    cells = {(label, step): (value, color) for label, step, value, color in drawn}
    assert len(drawn) == len(stored) == len(cells)  # one cell per row, no duplicates
    threshold = 0.1  # quickstart: base.entropy_collapse_threshold
    below = set()
    for lay, hd, step, value in stored:
        shown, color = cells[(f"L{lay} H{hd}", step)]
        assert shown == value
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
    label = f"L{layer} H{head}"
    on_screen = p.evaluate(
        f"([l, s1, s2]) => [{heat}.pixelAt(l, s1), {heat}.pixelAt(l, s2)]",
        [label, ui_seed.COLLAPSE_FROM, ui_seed.STEPS[0]],
    )
    assert on_screen[0] == COLLAPSED_COLOR and on_screen[1] != COLLAPSED_COLOR, on_screen
    # Hovering a cell names it (the tooltip finds the cell from the mouse position).
    box = p.locator(f"#heatmap-{tid} canvas").bounding_box()
    xy = p.evaluate(
        f"([r, c]) => {heat}.centre(r, c)",
        [[f"L{lay} H{hd}" for lay in ui_seed.LAYERS for hd in ui_seed.HEADS].index(label),
         ui_seed.STEPS.index(ui_seed.COLLAPSE_FROM)],
    )  # fmt: skip
    p.mouse.move(box["x"] + xy["x"], box["y"] + xy["y"])
    value = cells[(label, ui_seed.COLLAPSE_FROM)][0]
    tip = p.inner_text(f"#heatmap-{tid} .heat-tip")
    assert tip == f"{label}, step {ui_seed.COLLAPSE_FROM}: {value:.4f}"
    assert p.get_attribute(f"#heatmap-{tid}", "data-collapsed") == label
    note = p.inner_text(f"#collapsed-{tid}")
    assert f"{label} (from step {ui_seed.COLLAPSE_FROM}" in note and "0.1" in note
    # Per-head QK curves: every head (4 here), or the heads of the layer picked.
    heads = f"() => window.qkCharts.get('eigmean-{tid}').getOption().series.map(s => s.name)"
    assert p.evaluate(heads) == ["L1 H0", "L1 H1", "L2 H0", "L2 H1"]
    p.select_option(f"#heads-layer-{tid}", "2")
    p.wait_for_function(f"() => ({heads})().join() === 'L2 H0,L2 H1'", timeout=WAIT_MS)
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


def test_a_stopped_trial_shows_why_in_the_table_and_on_its_page(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """Issue 25: a trial stopped as infeasible (or by the pruner) says why, in the study's
    trial table and on the trial's own page, as the API stores it."""
    _, engine, _ = db
    sid = ui_seed.add_study(engine, "stopped-reasons", "RUNNING")
    tid = ui_seed.add_trial(engine, sid, 0, "PRUNED", ui_seed.STEPS[:1])
    reason = "min_norm_entropy_ever 0.0048 < 0.1 at step 50"
    with Session(engine) as s:
        s.execute(update(Trial).where(Trial.id == tid).values(stop_reason=reason))
        s.commit()
    p = page.open(f"#/studies/{sid}", "study")
    wait_numbers(p, [0])
    assert p.inner_text("#trials-body tr[data-number='0'] .stop-reason") == reason
    page.open(f"#/trials/{tid}", "trial")
    p.wait_for_selector(".stop-reason", timeout=WAIT_MS)
    assert p.inner_text(".stop-reason") == f"stopped: {reason}"
    assert page.errors == [], page.errors


def test_a_trial_past_one_series_page_is_drawn_whole(
    browser: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """/series answers at most 200,000 rows a call (issue 27: it used to answer 2 M); the
    trial page follows `next_cursor` and draws every row of a trial that has more."""
    from service.api.series import MAX_ROWS
    from service.store.ingest import insert_metrics

    url = f"sqlite:///{tmp_path_factory.mktemp('bigdb') / 'qkscope.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        sid = ui_seed.add_study(engine, "big", status="COMPLETED")
        tid = ui_seed.add_trial(engine, sid, 0, "COMPLETE", ui_seed.STEPS)
        extra = MAX_ROWS + 5_000
        with Session(engine) as s:
            insert_metrics(
                s,
                [
                    {"trial_id": tid, "name": "reg_penalty", "step": 1000 + i, "value": i / extra}
                    for i in range(extra)
                ],
            )
            s.commit()
            stored = s.scalar(
                select(func.count())
                .select_from(Metric)
                .where(Metric.trial_id == tid, Metric.name == "reg_penalty")
            )
        assert stored == extra + len(ui_seed.STEPS)
        for base in _serve(url, tmp_path_factory.mktemp("home"), ""):
            page = Page(browser, base)
            try:
                p = page.open(f"#/trials/{tid}", "trial")
                drawn = p.evaluate(
                    f"() => window.qkCharts.get('penalty-{tid}').getOption().series"
                    ".map(s => s.data.length)"
                )
                assert drawn == [stored]
                assert any("cursor=" in u for u in page.urls if "/series" in u), page.urls
                assert page.errors == [], page.errors
            finally:
                page.close()
    finally:
        engine.dispose()


def test_with_tokens_no_data_without_a_valid_token(
    browser: Any, secured_site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    seeded = db[2]
    # The shell needs no token; the UI's other files (issue 42) and every data route do.
    assert httpx.get(f"{secured_site}/ui/").status_code == 200
    assert httpx.get(f"{secured_site}/ui/js/app.js").status_code == 401
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


def test_the_series_route_groups_what_metrics_returns(db_url: str, tmp_path: Path) -> None:
    """What the heatmap reads: /series is /metrics regrouped (same rows, same order, the same
    doubles), on SQLite (grouped in Python) and PostgreSQL (grouped by the database)."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.store.ingest import insert_metrics

    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    try:
        sid = ui_seed.add_study(engine, "series")
        tid = ui_seed.add_trial(engine, sid, 0, "COMPLETE", ui_seed.STEPS)
        odd = [None, 1e-300, 0.1, 1 / 3, 123456789.123456, -2.5e10, 5e-324]
        with Session(engine) as s:
            insert_metrics(s, [{"trial_id": tid, "name": "lr", "step": 1000 + i, "value": v}
                               for i, v in enumerate(odd)])  # fmt: skip
            s.commit()
            stored = s.scalar(
                select(func.count()).select_from(Metric).where(Metric.trial_id == tid)
            )
        settings = Settings(database_url=db_url, ray_address="", api_tokens="", home=tmp_path)
        with TestClient(create_app(settings, reconcile_loop=False)) as c:

            def get(path: str, **params: Any) -> Any:
                r = c.get(path, params=params)
                assert r.status_code == 200, r.text
                return r.json()

            rows = get(f"/v1/trials/{tid}/metrics", limit=100_000)
            assert len(rows) == stored
            grouped = get(f"/v1/trials/{tid}/series")
            assert grouped["trial_id"] == tid
            assert grouped["rows"] == len(rows) and not grouped["truncated"]
            flat = [
                {"name": s["name"], "layer": s["layer"], "head": s["head"], "step": st, "value": v}
                for s in grouped["series"]
                for st, v in zip(s["steps"], s["values"], strict=True)
            ]
            assert flat == rows
            lr = [r["value"] for r in rows if r["name"] == "lr" and r["step"] >= 1000]
            assert lr == odd  # exact doubles, null kept
            one = get(
                f"/v1/trials/{tid}/series",
                name=["rank_ratio", "val_loss"],
                step_min=100,
                step_max=200,
            )
            assert [(s["name"], s["layer"], s["steps"]) for s in one["series"]] == [
                *(("rank_ratio", ly, [100, 150, 200]) for ly in (0, 1, 2)),
                ("val_loss", None, [100, 150, 200]),
            ]
            assert one["rows"] == 12
            cut = get(f"/v1/trials/{tid}/series", limit=10)
            assert cut["truncated"] is True and cut["rows"] == 10
            assert sum(len(s["steps"]) for s in cut["series"]) == 10
            assert c.get("/v1/trials/999999/series").status_code == 404
            r = c.get(f"/v1/trials/{tid}/series", params={"step_min": 5, "step_max": 1})
            assert r.status_code == 422 and r.json()["errors"][0]["field"] == "step_min"
    finally:
        engine.dispose()


def chart_point_xy(p: Any, chart_id: str, series: int, index: int) -> tuple[float, float]:
    """Page coordinates of one drawn data point of an ECharts chart."""
    xy = p.evaluate(
        """([id, s, i]) => {
        const c = window.qkCharts.get(id);
        return c.convertToPixel({seriesIndex: s}, c.getOption().series[s].data[i].slice(0, 2));
    }""",
        [chart_id, series, index],
    )
    box = p.locator(f"#{chart_id}").bounding_box()
    return box["x"] + xy[0], box["y"] + xy[1]


def test_metric_routes_answer_bounded_pages_that_add_up(db_url: str, tmp_path: Path) -> None:
    """Issue 27: /metrics answered up to 1 M rows a call and /series 2 M. Now /metrics
    answers 10,000 by default and 100,000 at most, /series 200,000 at most, each with a
    cursor to the next page; paging through either gives every row once, in order, on
    SQLite and PostgreSQL (where the database writes the series' JSON)."""
    from fastapi.testclient import TestClient

    from service.api.series import MAX_ROWS
    from service.api.trials import MAX_METRIC_ROWS
    from service.app import create_app
    from service.store.ingest import insert_metrics

    migrate.upgrade(db_url)
    engine = make_engine(db_url)
    try:
        sid = ui_seed.add_study(engine, "pages")
        tid = ui_seed.add_trial(engine, sid, 0, "COMPLETE", ui_seed.STEPS)
        with Session(engine) as s:
            insert_metrics(
                s,
                [{"trial_id": tid, "name": "lr", "step": i, "value": i / 7} for i in range(25_000)],
            )
            s.commit()
            stored = [
                (n, None if ly < 0 else ly, None if hd < 0 else hd, st, v)
                for n, ly, hd, st, v in s.execute(
                    select(Metric.name, Metric.layer, Metric.head, Metric.step, Metric.value)
                    .where(Metric.trial_id == tid)
                    .order_by(Metric.name, Metric.layer, Metric.head, Metric.step)
                ).all()
            ]
        settings = Settings(database_url=db_url, ray_address="", api_tokens="", home=tmp_path)
        with TestClient(create_app(settings, reconcile_loop=False)) as c:
            first = c.get(f"/v1/trials/{tid}/metrics")
            assert first.status_code == 200 and len(first.json()) == 10_000
            assert first.headers["x-next-cursor"] and 'rel="next"' in first.headers["link"]
            for route, too_many in (("metrics", MAX_METRIC_ROWS + 1), ("series", MAX_ROWS + 1)):
                r = c.get(f"/v1/trials/{tid}/{route}", params={"limit": too_many})
                assert r.status_code == 422 and r.json()["errors"][0]["field"] == "limit"
                r = c.get(f"/v1/trials/{tid}/{route}", params={"cursor": "bm90IGEgY3Vyc29y"})
                assert r.status_code == 422 and r.json()["errors"][0]["field"] == "cursor"

            rows: list[tuple[Any, ...]] = []
            cursor = None
            while True:
                r = c.get(f"/v1/trials/{tid}/metrics", params={"limit": 7_000, "cursor": cursor})
                assert r.status_code == 200, r.text
                page = r.json()
                assert len(page) <= 7_000
                rows += [(m["name"], m["layer"], m["head"], m["step"], m["value"]) for m in page]
                cursor = r.headers.get("x-next-cursor")
                if cursor is None:
                    break
            assert rows == stored

            rows, cursor, pages = [], None, 0
            while True:
                r = c.get(f"/v1/trials/{tid}/series", params={"limit": 4_000, "cursor": cursor})
                assert r.status_code == 200, r.text
                body = r.json()
                pages += 1
                assert body["rows"] <= 4_000 and body["truncated"] == (
                    body["next_cursor"] is not None
                )
                rows += [
                    (x["name"], x["layer"], x["head"], st, v)
                    for x in body["series"]
                    for st, v in zip(x["steps"], x["values"], strict=True)
                ]
                cursor = body["next_cursor"]
                if cursor is None:
                    break
            assert rows == stored and pages == -(-len(stored) // 4_000)
            whole = c.get(f"/v1/trials/{tid}/series").json()
            assert whole["rows"] == len(stored) and whole["next_cursor"] is None
    finally:
        engine.dispose()


def test_clicking_a_phase_map_point_opens_its_trial(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    seeded = db[2]
    sid = seeded.finished_id
    p = page.open(f"#/studies/{sid}", "study")
    p.wait_for_selector("html[data-readystudycharts]", state="attached", timeout=WAIT_MS)
    chart = f"phase-{sid}"
    # Every point drawn, as (series, index, trial number, pixel); click the one farthest
    # from its neighbours so that no other symbol is under the mouse.
    series = p.evaluate(
        f"() => window.qkCharts.get('{chart}').getOption().series.map(s => s.data.map(d => d[3]))"
    )
    points = [
        (si, i, number, chart_point_xy(p, chart, si, i))
        for si, numbers in enumerate(series)
        for i, number in enumerate(numbers)
    ]
    assert sorted(pt[2] for pt in points) == list(range(8))

    def room(pt: Any) -> float:
        return min(
            (pt[3][0] - q[3][0]) ** 2 + (pt[3][1] - q[3][1]) ** 2 for q in points if q is not pt
        )

    _, _, number, (x, y) = max(points, key=room)
    p.mouse.click(x, y)
    tid = seeded.trial_ids[number]
    p.wait_for_function(f"() => location.hash === '#/trials/{tid}'", timeout=WAIT_MS)
    p.wait_for_selector("html[data-readytrial]", state="attached", timeout=WAIT_MS)
    assert f"/ trial {number}" in p.inner_text(f"#trial-{tid} .trial-title")
    assert page.errors == [], page.errors


def test_a_two_objective_study_shows_its_pareto_front(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    seeded = db[2]
    sid = seeded.pareto_id
    p = page.open(f"#/studies/{sid}", "study")
    p.wait_for_selector("html[data-readystudycharts]", state="attached", timeout=WAIT_MS)
    drawn = p.evaluate(
        f"""() => Object.fromEntries(window.qkCharts.get('pareto-{sid}').getOption().series
        .map(s => [s.name, s.data.map(d => d[2])]))"""
    )
    # The front computed here from the seeded values: feasible trials no other feasible
    # trial beats on both objectives (loss down, entropy up).
    feasible = {n: v for n, v in seeded.pareto_values.items() if v[2]}
    front = {
        n
        for n, (loss, ent, _) in feasible.items()
        if not any(
            lo <= loss and en >= ent and (lo, en) != (loss, ent) for lo, en, _ in feasible.values()
        )
    }
    assert 1 < len(front) < len(feasible)
    assert sorted(drawn["Pareto front"]) == sorted(front)
    assert sorted(drawn["dominated"]) == sorted(set(seeded.pareto_values) - front)
    assert page.errors == [], page.errors


def test_the_importance_panel_draws_what_the_importance_route_answers(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    sid = db[2].finished_id
    p = page.open(f"#/studies/{sid}", "study")
    chart = f"importance-{sid}"
    bars = (
        f"() => {{ const c = window.qkCharts.get('{chart}'); const o = c && c.getOption();"
        " return o && o.series.length ? [o.yAxis[0].data, o.series[0].data] : null; }"
    )
    p.wait_for_function(bars, timeout=WAIT_MS)
    names, values = p.evaluate(bars)
    want = api(site, f"/v1/studies/{sid}/importance")
    assert want["n_trials"] == 8
    assert names == list(reversed(want["importances"]))  # largest at the top
    assert values == pytest.approx(list(reversed(want["importances"].values())))
    assert set(names) == {"regularizer.lambda", "model.qk_init_std"}
    assert page.errors == [], page.errors


def test_the_trial_table_pages_as_the_api_orders_trials(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    sid = db[2].pareto_id
    n = ui_seed.PARETO_TRIALS
    p = page.open(f"#/studies/{sid}", "study")
    assert numbers_shown(p) == list(range(50))
    assert p.inner_text("#trials-info") == f"1-50 of {n}"

    def expected(**params: Any) -> list[int]:
        items = api(site, f"/v1/studies/{sid}/trials", limit=50, **params)["items"]
        return [t["number"] for t in items]

    p.click("#trials th[data-sort='min_norm_entropy']")  # sorted, then the second page
    wait_numbers(p, expected(sort="min_norm_entropy", offset=0))
    p.click(".pager button:has-text('next')")
    second = expected(sort="min_norm_entropy", offset=50)
    assert len(second) == n - 50
    wait_numbers(p, second)
    assert p.inner_text("#trials-info") == f"51-{n} of {n}"
    assert p.is_disabled(".pager button:has-text('next')")
    p.click(".pager button:has-text('previous')")
    wait_numbers(p, expected(sort="min_norm_entropy", offset=0))
    assert page.errors == [], page.errors


def test_the_studies_page_follows_a_study_without_reload(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    engine = db[1]
    sid = ui_seed.add_study(engine, "quickstart-live")  # PENDING, nothing run yet
    p = page.open("#/", "studies")
    row = f"#studies-body tr[data-study='{sid}']"
    assert "PENDING" in p.inner_text(row) and "0/8" in p.inner_text(row)
    # The runner starts it and a first trial finishes: the row follows (polled).
    ui_seed.set_study(engine, sid, status="RUNNING", ray_job_id=f"qkscope-study-{sid}-a1-222222")
    ui_seed.add_bare_trials(engine, sid, range(1))
    p.wait_for_function(
        f"""() => {{ const t = document.querySelector("{row}").textContent;
        return t.includes('RUNNING') && t.includes('1/8') && t.includes('-222222'); }}""",
        timeout=WAIT_MS,
    )
    assert p.get_attribute(f"{row} progress", "value") == "0.125"
    assert page.errors == [], page.errors


def test_a_token_revoked_while_a_page_polls_shows_the_prompt_not_stale_data(
    browser: Any, db: tuple[str, Engine, ui_seed.Seeded], tmp_path: Path
) -> None:
    """The server restarts with the page's token no longer in QKSCOPE_API_TOKENS: the next
    poll is refused, and the page drops its data for the token prompt."""
    url, _, seeded = db
    port = free_port()
    server = Server(url, tmp_path, TOKEN, port)
    page = Page(browser, server.base)
    try:
        p = page.open(f"#/studies/{seeded.running_id}", None)  # RUNNING: the summary is polled
        p.fill("#token", TOKEN)
        p.click(".token-form button[type=submit]")
        p.wait_for_selector("html[data-readystudy]", state="attached", timeout=WAIT_MS)
        assert numbers_shown(p) != []
        server.stop()
        server = Server(url, tmp_path, "another-token", port)
        p.wait_for_selector(".token-form", timeout=WAIT_MS)
        assert "not accepted" in p.inner_text("#auth-message")
        assert p.locator("#trials, #summary, .trial-col").count() == 0
        assert p.evaluate("() => sessionStorage.getItem('qkscope.token')") is None
        # What the browser logs: the 401, and refused connections while the server restarted.
        assert all(re.search(r"status of 401|ERR_CONNECTION", e) for e in page.errors), page.errors
        assert any("status of 401" in e for e in page.errors)
    finally:
        page.close()
        server.stop()


def test_a_large_study_ranks_by_ped_anova_and_computes_fanova_on_request(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """Past 200 COMPLETE trials fANOVA costs the server seconds to minutes: the panel shows
    PED-ANOVA and offers fANOVA."""
    engine = db[1]
    sid = ui_seed.add_study(engine, "quickstart-large", "COMPLETED", n_trials=201)
    ui_seed.add_bare_trials(engine, sid, range(201))
    p = page.open(f"#/studies/{sid}", "importance")
    chart = f"window.qkCharts.get('importance-{sid}').getOption()"
    assert p.evaluate(f"() => {chart}.title[0].text") == "final_val_loss (ped_anova, 201 trials)"
    want = api(site, f"/v1/studies/{sid}/importance", evaluator="ped_anova")["importances"]
    assert p.evaluate(f"() => {chart}.yAxis[0].data") == list(reversed(want))
    p.click(f"#importance-fanova-{sid}")
    p.wait_for_function(
        f"() => {chart}.title[0].text === 'final_val_loss (fanova, 201 trials)'", timeout=60_000
    )
    assert p.inner_text(f"#importance-note-{sid}") == ""
    assert page.errors == [], page.errors


def test_the_lr_sensitivity_panel_draws_what_the_route_answers(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """One line per group at the route's medians on a log lr axis, each group's l_0 dashed in
    its colour, its sensitivity in the legend; no panel where the study does not search lr."""
    from tests.service.lr_seed import seed_lr_study

    sid = seed_lr_study(db[1], "ui-lr-sensitivity")
    p = page.open(f"#/studies/{sid}", "lrsens")
    drawn = p.evaluate(
        f"""() => {{ const o = window.qkCharts.get('lrsens-{sid}').getOption();
        return {{x: o.xAxis[0].type, series: o.series.map(s => ({{
            name: s.name, type: s.type, color: s.color,
            data: s.data.map(d => d.value || d),
            l0: s.markLine ? s.markLine.data[0].yAxis : null,
            dash: s.markLine ? s.markLine.lineStyle.type : null,
            l0color: s.markLine ? s.markLine.lineStyle.color : null}}))}}; }}"""
    )
    want = api(site, f"/v1/studies/{sid}/lr-sensitivity")
    assert drawn["x"] == "log"
    lines = [s for s in drawn["series"] if s["type"] == "line"]
    bars = [s for s in drawn["series"] if s["type"] == "custom"]
    assert len(lines) == len(bars) == len(want["groups"]) == 2
    for line, bar, g in zip(lines, bars, want["groups"], strict=True):
        curve = [c for c in g["curve"] if c["median"] is not None]
        # min(l, l_0) per seed, what the definition uses (the "none" group's lr 0.1 ends
        # above l_0: drawn at it)
        assert line["data"] == [[c["lr"], c["clipped_median"]] for c in curve]
        assert bar["data"] == [
            [c["lr"], c["clipped_min"], c["clipped_max"]] for c in curve if c["n"] > 1
        ]
        assert any(c["clipped_median"] < c["median"] for c in curve) == (
            g["params"]["model.qk_norm"] == "none"
        )
        assert line["l0"] == pytest.approx(g["l0"]) and line["dash"] == "dashed"
        assert line["l0color"] == line["color"]
        label = ", ".join(f"{k}={v}" for k, v in g["params"].items())
        sens = float(f"{g['sensitivity']:.3g}")
        assert line["name"].startswith(f"{label}: LR sensitivity {sens}")
    note = p.inner_text(f"#lrsens-note-{sid}")
    assert "1 seed(s) left out" in note
    page.shot("lr_sensitivity_page")
    out = os.environ.get("QKSCOPE_UI_SCREENSHOTS")
    if out:
        p.locator(f"#lrsens-panel-{sid}").screenshot(path=str(Path(out) / "lr_sensitivity.png"))
    assert page.errors == [], page.errors

    quick = db[2].finished_id  # the quickstart: optim.lr is not searched
    p.evaluate("() => { delete document.documentElement.dataset.readystudycharts; }")
    page.open(f"#/studies/{quick}", "studycharts")
    assert p.locator(f"#lrsens-panel-{quick}").count() == 0
    assert not any("lr-sensitivity" in u for u in page.urls if f"/studies/{quick}/" in u)
    assert page.errors == [], page.errors


def test_the_stability_boundary_panel_draws_what_the_route_answers(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """eta_max and eta_opt against width on log-log axes, each group's fit to the target
    width with its band, one colour per group; the held-out ratio in the note."""
    from tests.service.boundary_seed import seed_boundary_study

    sid = seed_boundary_study(db[1], "ui-boundary")
    p = page.open(f"#/studies/{sid}", "boundary")
    drawn = p.evaluate(
        f"""() => {{ const o = window.qkCharts.get('boundary-{sid}').getOption();
        return {{x: o.xAxis[0].type, y: o.yAxis[0].type, series: o.series.map(s => ({{
            name: s.name, type: s.type, color: s.color, symbol: s.symbol || null,
            data: s.data.map(d => d.value || d)}}))}}; }}"""
    )
    want = api(site, f"/v1/studies/{sid}/stability-boundary")
    assert (drawn["x"], drawn["y"]) == ("log", "log")
    colors = []
    for g in want["groups"]:
        label = ", ".join(f"{k}={v}" for k, v in g["params"].items())
        mine = [s for s in drawn["series"] if s["name"].startswith(f"{label}: b ")]
        dots = [s for s in mine if s["type"] == "scatter"]
        emax = [[q["width"], q["eta_max"]] for q in g["points"] if q["eta_max"] is not None]
        eopt = [[q["width"], q["eta_opt"]] for q in g["points"] if q["eta_opt"] is not None]
        assert [s["data"] for s in dots] == [emax, eopt]
        (fit, opt) = [s for s in mine if s["type"] == "line"]
        band = g["eta_max_fit"]["band"]
        assert fit["data"] == [[b["width"], b["eta"]] for b in band]
        assert fit["data"][-1][0] == pytest.approx(want["target_width"])
        assert opt["data"] == [[b["width"], b["eta"]] for b in g["eta_opt_fit"]["band"]]
        (shade,) = [s for s in mine if s["type"] == "custom"]
        assert shade["data"] == [[b["width"], b["low"], b["high"]] for b in band]
        assert len({s["color"] for s in mine}) == 1
        colors.append(mine[0]["color"])
    assert len(set(colors)) == len(want["groups"]) == 2
    note = p.inner_text(f"#boundary-note-{sid}")
    assert "Held out" in note and "undefined" in note
    out = os.environ.get("QKSCOPE_UI_SCREENSHOTS")
    if out:
        p.locator(f"#boundary-panel-{sid}").screenshot(
            path=str(Path(out) / "stability_boundary.png")
        )
    assert page.errors == [], page.errors


def test_the_lr_panel_draws_the_unigram_floor_and_says_when_l_star_is_not_below_it(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded], tmp_path: Path
) -> None:
    """METRICS.md 9: a dotted line at the route's unigram floor in each group's colour, and
    the route's note under the panel when a group's l* is not below it (a two-letter corpus:
    floor about 0.8 nats, l* about 3.1)."""
    from tests.service.lr_seed import seed_char_lm_study

    data = tmp_path / "ab"
    data.mkdir()
    (data / "train.txt").write_text("ab" * 20)
    (data / "valid.txt").write_text("ab" * 20)
    sid = seed_char_lm_study(db[1], "ui-lr-floor", str(data))
    want = api(site, f"/v1/studies/{sid}/lr-sensitivity")
    floors = {g["unigram_floor"] for g in want["groups"]}
    assert len(floors) == 1 and None not in floors
    (floor,) = floors
    p = page.open(f"#/studies/{sid}", "lrsens")
    drawn = p.evaluate(
        f"""() => window.qkCharts.get('lrsens-{sid}').getOption().series
        .filter(s => s.type === 'line').map(s => ({{color: s.color,
            lines: s.markLine.data.map(d => [d.name, d.yAxis,
                d.lineStyle ? d.lineStyle.type : s.markLine.lineStyle.type,
                d.lineStyle ? d.lineStyle.color : s.markLine.lineStyle.color])}}))"""
    )
    assert len(drawn) == 2
    for line, g in zip(drawn, want["groups"], strict=True):
        assert line["lines"] == [
            ["l0", pytest.approx(g["l0"]), "dashed", line["color"]],
            ["unigram floor", pytest.approx(floor), "dotted", line["color"]],
        ]
    note = p.inner_text(f"#lrsens-note-{sid}")
    assert note.count("is not below the unigram floor") == 2, note
    assert page.errors == [], page.errors


def y_extent(p: Any, chart_id: str) -> list[float]:
    """The y axis range an ECharts chart really drew."""
    return p.evaluate(
        f"""() => window.qkCharts.get('{chart_id}').getModel().getComponent('yAxis', 0)
        .axis.scale.getExtent()"""
    )


def test_a_blown_up_run_is_drawn_at_l0_marked_with_its_raw_loss(
    page: Page, site: str, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """Issue 46 (6): a new user's grid up to lr 3, one seed, no description. Two runs blew up
    to 137 and 284 nats without going non-finite (l_0 is 2.9, the others end at 1.7-2.3):
    every loss plot ends its y axis about l_0, draws those losses at l_0 as a hollow
    triangle with the raw value in the tooltip, and the page says no "null"."""
    from tests.service.lr_seed import (
        BLOWUP_FINALS,
        BLOWUP_GRID,
        BLOWUP_L0,
        seed_blowup_study,
    )

    sid, ids = seed_blowup_study(db[1], "ui-first-grid")
    blown = {eta: f for eta, f in zip(BLOWUP_GRID, BLOWUP_FINALS, strict=True) if f and f > 10}
    assert sorted(blown.values()) == [137.0, 284.0]
    low = min(f for f in BLOWUP_FINALS if f is not None)
    top = BLOWUP_L0 + 0.1 * (BLOWUP_L0 - low)  # l_0 plus a margin, far below 137
    p = page.open(f"#/studies/{sid}", "lrsens")

    # No description: nothing between the title and the cards, no "null" anywhere.
    assert p.locator("#study-description").count() == 0
    text = p.inner_text("#view")
    assert not re.search(r"\b(null|undefined)\b", text), text[:300]
    strays = p.evaluate(
        "() => [...document.getElementById('view').childNodes]"
        ".filter(n => n.nodeType === 3 && n.textContent.trim()).map(n => n.textContent)"
    )
    assert strays == []

    # The LR panel: min(l, l_0), the two blown-up medians at l_0 and marked.
    chart = f"lrsens-{sid}"
    lo, hi = y_extent(p, chart)
    assert BLOWUP_L0 <= hi <= top and lo < low, (lo, hi)
    pts = p.evaluate(
        f"""() => window.qkCharts.get('{chart}').getOption().series[0].data.map(d => ({{
            x: d.value[0], y: d.value[1], symbol: d.symbol || null, raw: d.raw}}))"""
    )
    assert [q["x"] for q in pts] == BLOWUP_GRID
    for q, final in zip(pts, BLOWUP_FINALS, strict=True):
        want = BLOWUP_L0 if final is None else min(final, BLOWUP_L0)
        assert q["y"] == pytest.approx(want)
        assert (q["symbol"] == "emptyTriangle") == (q["x"] in blown), q
    # Hovering the 284-nat point shows its raw value.
    i = BLOWUP_GRID.index(max(blown, key=lambda eta: blown[eta]))
    x, y = chart_point_xy_value(p, chart, 0, i)
    p.mouse.move(x, y)
    p.wait_for_function(
        f"() => document.querySelector('#{chart}').innerText.includes('highest 284')",
        timeout=WAIT_MS,
    )
    tip = p.inner_text(f"#{chart}")
    assert "1 of 1 above l" in tip and "min(l, l" in tip, tip

    # The optimisation history: the same ceiling (the study's step-0 loss), the two
    # blown-up trials in the marked series with their raw values.
    p.wait_for_selector("html[data-readystudycharts]", state="attached", timeout=WAIT_MS)
    hist = f"history-{sid}"
    lo, hi = y_extent(p, hist)
    assert BLOWUP_L0 <= hi <= top, (lo, hi)
    above = p.evaluate(
        f"""() => window.qkCharts.get('{hist}').getOption().series
        .filter(s => s.symbol === 'emptyTriangle')
        .flatMap(s => s.data.map(d => [d.value[1], d.raw]))"""
    )
    assert sorted(above) == [[pytest.approx(BLOWUP_L0), 137.0], [pytest.approx(BLOWUP_L0), 284.0]]
    # The phase map (y: final_val_loss by default here) under the same rule; a trial without
    # a collapse class is "unclassified" in its legend, not "null".
    phase = f"phase-{sid}"
    lo, hi = y_extent(p, phase)
    assert BLOWUP_L0 <= hi <= top, (lo, hi)
    drawn = p.evaluate(
        f"""() => window.qkCharts.get('{phase}').getOption().series.map(s => [s.name,
        s.data.map(d => d.raw ? [d.value[1], d.raw[1]] : d[1])])"""
    )
    names = [name for name, _ in drawn]
    assert "null" not in names and "unclassified" in names, names
    (marked,) = [pts for name, pts in drawn if name.startswith("above l")]
    assert sorted(marked) == [[pytest.approx(BLOWUP_L0), 137.0], [pytest.approx(BLOWUP_L0), 284.0]]
    out = os.environ.get("QKSCOPE_UI_SCREENSHOTS")
    if out:  # docs/ui/lr_sensitivity_blowup.png
        p.locator(f"#lrsens-panel-{sid}").screenshot(
            path=str(Path(out) / "lr_sensitivity_blowup.png")
        )

    # The trial's loss plot: its own l_0 (step 0) as ceiling; the blow-up marked.
    tid = ids[max(blown, key=lambda eta: blown[eta])]
    p.evaluate("() => { delete document.documentElement.dataset.readytrial; }")
    page.open(f"#/trials/{tid}", "trial")
    loss = f"loss-{tid}"
    p.wait_for_function(f"() => window.qkCharts.get('{loss}')", timeout=WAIT_MS)
    lo, hi = y_extent(p, loss)
    assert BLOWUP_L0 <= hi <= BLOWUP_L0 + 0.1 * (BLOWUP_L0 - 2.3), (lo, hi)
    marked = p.evaluate(
        f"""() => Object.fromEntries(window.qkCharts.get('{loss}').getOption().series
        .filter(s => s.symbol === 'emptyTriangle')
        .map(s => [s.name, s.data.map(d => [d.value[0], d.raw])]))"""
    )
    assert marked["val_loss above l\u2080"] == [[75, 71.0], [100, 284.0]]
    assert [st for st, _ in marked["train_loss above l\u2080"]] == [1, 75, 100]
    assert page.errors == [], page.errors


def chart_point_xy_value(p: Any, chart_id: str, series: int, index: int) -> tuple[float, float]:
    """Page coordinates of a data point given as {value: [x, y], ...}."""
    xy = p.evaluate(
        """([id, s, i]) => {
        const c = window.qkCharts.get(id);
        return c.convertToPixel({seriesIndex: s}, c.getOption().series[s].data[i].value);
    }""",
        [chart_id, series, index],
    )
    box = p.locator(f"#{chart_id}").bounding_box()
    return box["x"] + xy[0], box["y"] + xy[1]


def test_without_a_step_0_a_trial_loss_axis_ends_at_its_first_losses(
    page: Page, db: tuple[str, Engine, ui_seed.Seeded]
) -> None:
    """The quickstart study evaluates from step 50 (no eval_at_init): the loss plot's ceiling
    is the larger of the trial's first stored val_loss and train_loss, read here from the
    database, and the dashed line says there was no step 0."""
    _, engine, seeded = db
    tid = seeded.trial_ids[3]
    firsts = []
    with Session(engine) as s:
        for name in ("val_loss", "train_loss"):
            step = s.execute(
                select(func.min(Metric.step)).where(Metric.trial_id == tid, Metric.name == name)
            ).scalar_one()
            assert step == ui_seed.STEPS[0] > 0
            firsts.append(
                s.execute(
                    select(Metric.value).where(
                        Metric.trial_id == tid, Metric.name == name, Metric.step == step
                    )
                ).scalar_one()
            )
    p = page.open(f"#/trials/{tid}", "trial")
    loss = f"loss-{tid}"
    p.wait_for_function(f"() => window.qkCharts.get('{loss}')", timeout=WAIT_MS)
    assert float(p.get_attribute(f"#{loss}", "data-ceiling")) == max(firsts)
    line = p.evaluate(f"() => window.qkCharts.get('{loss}').getOption().series[0].markLine.data[0]")
    assert line["yAxis"] == max(firsts) and line["name"].startswith("no step 0")
    lo, hi = y_extent(p, loss)
    assert max(firsts) <= hi < max(firsts) + 0.1 * (max(firsts) - lo)
    assert page.errors == [], page.errors
