"""The layer rules (pyproject.toml, [tool.importlinter]) hold, and the checker bites: the
same checker on a copy of the tree with one forbidden import added fails, naming it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT, "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)},
    )


def test_the_layer_contracts_are_kept() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("workers/engine.py", "import service.spec", "workers never import service"),
        ("service/api/studies.py", "import service.runner.loop", "never imports the study runner"),
        ("service/runner/loop.py", "from sqlalchemy import update", "only the store writes rows"),
        ("service/control/launch.py", "import sqlalchemy", "only the store writes rows"),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, module: str, line: str, contract: str
) -> None:
    for part in ("service", "workers", "qkscope"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert contract in out.stdout.replace("\n", " ")
