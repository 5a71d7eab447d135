"""The wheel ships the migrations: build it, install it (no deps, not editable) into a
throwaway virtual environment, and migrate a database from outside the repository."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from tests.conftest import ROOT

SOURCES = ("pyproject.toml", "setup.py", "README.md", "service", "workers", "migrations")


def test_installed_wheel_migrates_from_outside_the_repo(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # build from a copy: the checkout gets no build/ directory
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(p, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("qkscope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "qkscope_migrations/env.py" in names and "qkscope_migrations/script.py.mako" in names
    versions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    assert versions and all(f"qkscope_migrations/versions/{v}" in names for v in versions)
    ui = (
        "index.html",
        "style.css",
        "js/app.js",
        "vendor/echarts.esm.min.js",
        "vendor/echarts.LICENSE",
    )
    assert all(f"service/ui/static/{f}" in names for f in ui), [n for n in names if "/ui/" in n]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    subprocess.run(
        [
            *pip,
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            str(wheel),
        ],
        check=True,
        cwd=tmp_path,
    )
    # Then (so pip does not see the editable qkscope as installed) dependencies (alembic, SQLAlchemy, ...) from this environment's site-packages as a
    # plain path: its .pth files (the editable qkscope among them) are not processed there.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    db = tmp_path / "outside.db"
    out = subprocess.run(
        [
            str(py),
            "-c",
            "import service, sys; from service.store import migrate; "
            "print(service.__file__); print(migrate.migrations_dir()); "
            f"migrate.upgrade('sqlite:///{db}')",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.split()
    assert Path(out[0]).is_relative_to(site), out  # the installed copy, not the checkout
    assert Path(out[1]) == site / "qkscope_migrations", out
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        (head,) = conn.execute("SELECT version_num FROM qkscope_alembic_version").fetchone()
    assert {"qk_study", "qk_trial", "qk_metric"} <= tables
    assert head == max(v.split("_", 1)[0] for v in versions)
