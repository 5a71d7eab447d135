"""The service's modules (API and study runner) import without torch (startup cost, issue 10 item 3).

Each check runs in a fresh interpreter, because this test process has torch loaded already.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _torch_loaded_after(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=True,
    )
    return proc.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize(
    "module",
    [
        "workers.config",
        "workers.config_sections",
        "workers.curves",
        "workers.fusion_plan",
        "service.spec",
        "service.app",
        "service.runner",
    ],
)
def test_module_imports_without_torch(module: str) -> None:
    assert _torch_loaded_after(module) is False


def test_the_check_sees_torch_when_it_is_imported() -> None:
    """The probe itself can fail: a module that does import torch is reported as such."""
    assert _torch_loaded_after("workers.trial") is True


def test_config_types_are_the_same_objects_where_they_used_to_live() -> None:
    from workers import config, model, tasks, trial

    assert trial.TrialConfig is config.TrialConfig
    assert trial.TrialSummary is config.TrialSummary
    assert trial.MetricPoint is config.MetricPoint
    assert model.ModelConfig is config.ModelConfig
    assert tasks.TaskConfig is config.TaskConfig
