"""Every shipped study definition is a valid StudySpec within the default limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings
from service.spec import check_limits, parse_spec

DEFS = sorted((Path(__file__).resolve().parents[1] / "study_defs").glob("*.yaml"))


@pytest.mark.parametrize("path", DEFS, ids=[p.name for p in DEFS])
def test_study_definition_is_valid(path: Path) -> None:
    spec = parse_spec(path.read_bytes(), "application/yaml")
    s = Settings()
    assert (
        check_limits(spec, max_trials=s.max_trials, max_steps=s.max_steps, max_params=s.max_params)
        == []
    )
    assert spec.description, "each study definition documents its experiment"


def test_both_kinds_of_study_ship() -> None:
    names = {p.name for p in DEFS}
    assert {"quickstart.yaml", "gpu_locater_lm.yaml"} <= names
