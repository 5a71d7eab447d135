"""Studies whose resources no node can provide: refused at submission when the cluster can be
asked, else QUEUED trials with a visible waiting reason (never a silent RUNNING forever)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.config import Settings
from service.control.ray_cluster import JobLauncher, LocalRayHead
from service.resources import unmet
from service.store.models import Study
from service.store.session import make_engine
from tests.service.helpers import small_quickstart, wait_for


def test_unmet_names_the_missing_resource() -> None:
    nodes = [{"CPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}]
    assert unmet(1, 1, nodes) == []
    assert unmet(8, 1, nodes) == []
    assert [f for f, _ in unmet(1, 2, nodes)] == ["resources.gpus"]
    assert [f for f, _ in unmet(16, 0, nodes)] == ["resources.cpus"]
    assert [f for f, _ in unmet(16, 4, nodes)] == ["resources.gpus", "resources.cpus"]
    # Each fits on some node, never both on one: the pair is named.
    assert [f for f, _ in unmet(4, 1, [{"CPU": 8.0}, {"CPU": 1.0, "GPU": 1.0}])] == ["resources"]
    assert "1 GPU" in unmet(1, 1, [{"CPU": 2.0}])[0][1]


def settings_for(head: LocalRayHead, tmp_path: Path, **kw: Any) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp_path / 'qkscope.db'}",
        ray_address=head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
        **kw,
    )


def nodes_known(head: LocalRayHead) -> None:
    """Right after a head starts, Ray's state API lists no node for a few seconds (the API
    then cannot ask, and accepts the study); wait until it does."""
    launcher = JobLauncher(head.dashboard_url)
    deadline = time.monotonic() + 60
    while launcher.node_resources() is None:
        assert time.monotonic() < deadline, "Ray's state API lists no node"
        time.sleep(1.0)


@pytest.fixture
def app_client(ray_head: LocalRayHead, tmp_path: Path) -> Iterator[TestClient]:
    nodes_known(ray_head)
    with TestClient(create_app(settings_for(ray_head, tmp_path), reconcile_loop=False)) as c:
        yield c


def study_count(url: str) -> int:
    engine = make_engine(url)
    with engine.connect() as c:
        n = int(c.scalar(select(func.count()).select_from(Study)) or 0)
    engine.dispose()
    return n


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("resources", "field"),
    [({"cpus": 1, "gpus": 1}, "resources.gpus"), ({"cpus": 64, "gpus": 0}, "resources.cpus")],
)
def test_unsatisfiable_study_is_refused(
    app_client: TestClient, tmp_path: Path, resources: dict[str, float], field: str
) -> None:
    spec = {**small_quickstart(n_trials=2), "resources": resources}
    r = app_client.post("/v1/studies", json=spec)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "unsatisfiable_resources"
    assert [e["field"] for e in body["errors"]] == [field]
    assert study_count(f"sqlite:///{tmp_path / 'qkscope.db'}") == 0


@pytest.mark.cluster
def test_unaskable_cluster_shows_a_waiting_reason(ray_head: LocalRayHead, tmp_path: Path) -> None:
    settings = settings_for(ray_head, tmp_path, check_resources=False)
    with TestClient(create_app(settings, reconcile_loop=False)) as client:
        spec = {**small_quickstart(n_trials=2), "resources": {"cpus": 1, "gpus": 1}}
        r = client.post("/v1/studies", json=spec)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            study = client.get(f"/v1/studies/{sid}").json()
            if study["waiting_reason"]:
                break
            time.sleep(0.5)
        assert study["status"] == "RUNNING"
        assert "resources.gpus" in study["waiting_reason"], study
        trials = client.get(f"/v1/studies/{sid}/trials").json()["items"]
        assert len(trials) == 2  # parallelism 2: both launched, neither started
        for t in trials:
            assert t["state"] == "QUEUED"
            assert t["started_at"] is None and t["node"] is None
            assert "GPU" in t["waiting_reason"]
        assert (
            client.get(f"/v1/studies/{sid}/trials", params={"state": "QUEUED"}).json()["total"] == 2
        )
        assert client.post(f"/v1/studies/{sid}/cancel").json()["status"] == "CANCELLED"
        final = wait_for(client, sid, {"CANCELLED"}, timeout=30)
        assert final["status"] == "CANCELLED"
        states = {t["state"] for t in client.get(f"/v1/studies/{sid}/trials").json()["items"]}
        assert states == {"CANCELLED"}


@pytest.mark.cluster
def test_trials_waiting_for_a_slot_show_the_reason_too(
    ray_head: LocalRayHead, tmp_path: Path
) -> None:
    """`fuse: 2`, parallelism 1, a grid over n_layers: the two trials asked together cannot
    fuse (different shapes), so one group is launched and the other waits in the runner for
    the slot. Both are QUEUED and both say why they cannot start."""
    settings = settings_for(ray_head, tmp_path, check_resources=False)
    with TestClient(create_app(settings, reconcile_loop=False)) as client:
        spec = {
            **small_quickstart(n_trials=2),
            "resources": {"cpus": 1, "gpus": 1},
            "fuse": 2,
            "parallelism": 1,
            "sampler": {"kind": "grid"},
            "search_space": {"model.n_layers": {"type": "categorical", "choices": [1, 2]}},
        }
        r = client.post("/v1/studies", json=spec)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        deadline = time.monotonic() + 120
        trials: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            trials = client.get(f"/v1/studies/{sid}/trials").json()["items"]
            if len(trials) == 2 and all(t["waiting_reason"] for t in trials):
                break
            time.sleep(0.5)
        assert sorted(t["params"]["model.n_layers"] for t in trials) == [1, 2], trials
        for t in trials:
            assert t["state"] == "QUEUED"
            assert "GPU" in str(t["waiting_reason"]), trials
        assert client.post(f"/v1/studies/{sid}/cancel").json()["status"] == "CANCELLED"
        final = wait_for(client, sid, {"CANCELLED"}, timeout=30)
        assert final["status"] == "CANCELLED"
        states = {t["state"] for t in client.get(f"/v1/studies/{sid}/trials").json()["items"]}
        assert states == {"CANCELLED"}
