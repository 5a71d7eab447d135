"""Issue 42, item 6 (the loose ends): /healthz says nothing of the driver while the database
is down, and a trial's data is checked against the data root again where the trial opens it.

- /healthz needs no token: while the database is away it said the driver's first line, with
  the database's host and port (PostgreSQL) or its file (SQLite). Now only the error's kind.
- `task.data_dir` absent at the POST (so the POST could not follow a symlink) and later a
  symlink out of QKSCOPE_DATA_DIR trained on the outside data: the runner now gives each
  trial the root (`task.data_root`) and the worker refuses data that resolves outside it,
  which fails that trial with the reason. A definition cannot set the root itself.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.runner.configs import trial_config
from service.spec import StudySpec
from service.store import migrate
from tests.service.db_proxy import CuttableProxy
from tests.service.helpers import VALID, check_rejected
from workers.tasks import build_task
from workers.tasks_lm import DataOutsideRoot

# ---- /healthz --------------------------------------------------------------------------------


def _wait_health(c: TestClient, state: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (body := c.get("/healthz").json())["database"] != state:
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    return dict(body)


@pytest.fixture
def proxy(pg_db_url: str) -> Iterator[CuttableProxy]:
    migrate.upgrade(pg_db_url)
    p = CuttableProxy(pg_db_url)
    yield p
    p.close()


def test_healthz_names_no_postgresql_host_or_port_while_it_is_down(
    proxy: CuttableProxy, tmp_path: Path
) -> None:
    """Before: `database_error` was psycopg's first line, `connection to server at
    "127.0.0.1", port <n> failed: Connection refused`, to anyone without a token."""
    settings = Settings(database_url=proxy.url, api_tokens="secret", home=tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        _wait_health(c, "up")
        proxy.cut()
        assert c.get("/v1/studies", headers={"Authorization": "Bearer secret"}).status_code == 503
        body = _wait_health(c, "down")
        text = str(body)
        assert str(proxy.port) not in text and "127.0.0.1" not in text, body
        assert "refused" not in text.lower() and "server" not in text.lower(), body
        assert body == {
            "status": "degraded",
            "database": "down",
            "database_error": body["database_error"],
        }
        assert body["database_error"].isidentifier(), body  # a class name, e.g. OperationalError
        proxy.restore()
        _wait_health(c, "up")


def test_healthz_names_no_sqlite_file_while_it_is_away(tmp_path: Path) -> None:
    """SQLite's away is a file that cannot be opened (a lost mount): its path is not shown."""
    mount = tmp_path / "secret-mount-name"
    mount.mkdir()
    url = f"sqlite:///{mount / 'q.db'}"
    settings = Settings(database_url=url, api_tokens="secret", home=tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        _wait_health(c, "up")
        c.app.state.sessions.kw["bind"].dispose()  # type: ignore[attr-defined]
        shutil.rmtree(mount)
        r = c.get("/v1/studies", headers={"Authorization": "Bearer secret"})
        assert r.status_code == 503, r.text
        body = _wait_health(c, "down")
        assert "secret-mount-name" not in str(body) and "q.db" not in str(body), body
        assert "open" not in str(body), body
        mount.mkdir()


# ---- the data root ---------------------------------------------------------------------------


def _corpus(where: Path, text: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid"):
        (where / f"{split}.txt").write_text(text * 200)
    return where


def _lm_spec(data_dir: str) -> dict[str, Any]:
    body = copy.deepcopy(VALID)
    body["base"] = {
        "task": {"kind": "lm", "data_dir": data_dir, "tokenizer": "char", "vocab_cap": 64},
        "steps": 20,
        "eval_every": 10,
    }
    return body


@pytest.fixture
def data_client(db_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Settings]]:
    root = tmp_path / "data"
    root.mkdir()
    settings = Settings(database_url=db_url, api_tokens="", home=tmp_path, data_dir=str(root))
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        yield c, settings


def test_a_data_dir_symlinked_out_after_the_post_is_refused_where_the_trial_opens_it(
    data_client: tuple[TestClient, Settings], tmp_path: Path
) -> None:
    """The review's case, on SQLite and PostgreSQL: `later` does not exist at the POST (201),
    then becomes a symlink to a corpus outside the root. The config the runner builds for a
    trial carries the root, and opening the task refuses it (the worker fails that trial
    with this reason: its own error, `workers/slot_worker.py`), naming the data_dir as given
    and not where it leads. Before: the worker read the outside corpus."""
    c, settings = data_client
    r = c.post("/v1/studies", json=_lm_spec("later"))
    assert r.status_code == 201, r.text
    outside = _corpus(tmp_path / "outside-secret", "outside data ")
    os.symlink(outside, Path(settings.data_dir) / "later")
    spec = StudySpec.model_validate(r.json()["spec"])
    config = trial_config(spec, settings, r.json()["id"], {}, 0)
    assert config.task.data_root == settings.data_dir
    with pytest.raises(DataOutsideRoot) as err:
        build_task(config.task, config.seed)
    assert "'later'" in str(err.value) and "outside-secret" not in str(err.value)
    # A split file symlinked out of a directory inside the root is refused the same way.
    (Path(settings.data_dir) / "later").unlink()
    inside = Path(settings.data_dir) / "later"
    inside.mkdir()
    (inside / "train.txt").write_text("inside data " * 200)
    os.symlink(outside / "valid.txt", inside / "valid.txt")
    with pytest.raises(DataOutsideRoot):
        build_task(config.task, config.seed)
    # Inside the root (symlinks within it included) the trial reads its data.
    (inside / "valid.txt").unlink()
    _corpus(Path(settings.data_dir) / "real", "inside data ")
    shutil.rmtree(inside)
    os.symlink(Path(settings.data_dir) / "real", inside)
    task = build_task(config.task, config.seed)
    assert task.vocab_size > 2


def test_a_definition_cannot_set_the_data_root(data_client: tuple[TestClient, Settings]) -> None:
    c, _ = data_client
    body = _lm_spec("corpus")
    body["base"]["task"]["data_root"] = "/"
    out = check_rejected(c, body, "application/json")
    assert out["status"] == 422 and out["errors"][0]["field"] == "base.task.data_root", out
    body = _lm_spec("corpus")
    body["search_space"]["task.data_root"] = {"type": "categorical", "choices": ["/", "/tmp"]}
    out = check_rejected(c, body, "application/json")
    assert any(e["field"] == "search_space.task.data_root" for e in out["errors"]), out


def test_without_a_data_root_nothing_changes(tmp_path: Path) -> None:
    """QKSCOPE_DATA_DIR unset: relative paths are read from the worker's directory as before
    (only their spelling is checked at the POST), and no root is set."""
    spec = StudySpec.model_validate(_lm_spec(str(_corpus(tmp_path / "c", "abc "))))
    config = trial_config(spec, Settings(home=tmp_path, data_dir=""), 1, {}, 0)
    assert config.task.data_root is None
    assert build_task(config.task, config.seed).vocab_size > 2


def test_every_data_form_is_checked_against_the_root(tmp_path: Path) -> None:
    """The data forms of docs/your-data.md too: a `.bin` split symlinked out of the root is
    refused before it is mapped; inside the root the same files load."""
    import numpy as np

    from workers.config_sections import TaskConfig

    root, outside = tmp_path / "root", tmp_path / "outside"
    corpus = root / "tokens"
    corpus.mkdir(parents=True)
    outside.mkdir()
    ids = np.arange(4000, dtype=np.uint16) % 50
    ids.tofile(corpus / "train.bin")
    ids.tofile(outside / "valid.bin")
    os.symlink(outside / "valid.bin", corpus / "valid.bin")
    task = TaskConfig.model_validate(
        {
            "kind": "lm",
            "format": "bin",
            "data_dir": str(corpus),
            "data_root": str(root),
            "vocab_size": 64,
            "seq_len": 16,
        }
    )
    with pytest.raises(DataOutsideRoot):
        build_task(task, 0)
    (corpus / "valid.bin").unlink()
    ids.tofile(corpus / "valid.bin")
    assert build_task(task, 0).vocab_size == 64
