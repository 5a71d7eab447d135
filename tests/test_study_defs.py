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


@pytest.mark.parametrize("path", DEFS, ids=[p.name for p in DEFS])
def test_grid_studies_run_their_whole_grid_once(path: Path) -> None:
    """A grid study's budget is its grid: fewer trials leave points out, more repeat them."""
    spec = parse_spec(path.read_bytes(), "application/yaml")
    if spec.sampler.kind != "grid":
        pytest.skip("not a grid study")
    size = 1
    for p in spec.search_space.values():
        if p.type == "categorical":
            size *= len(p.choices)
        elif p.type in ("float", "int"):
            assert p.grid is not None
            size *= len(p.grid)
    assert spec.budget.n_trials == size


def test_reproduction_studies_ship() -> None:
    """docs/reproductions.md reports these; the rank-collapse one measures at initialisation."""
    names = {p.name for p in DEFS}
    repro = {
        "repro_rank_collapse.yaml",
        "repro_localization.yaml",
        "repro_localization_long.yaml",
        "repro_localization_seeds.yaml",
        "repro_stable_search.yaml",
    }
    assert repro <= names
    by_name = {p.name: parse_spec(p.read_bytes(), "application/yaml") for p in DEFS}
    rank = by_name["repro_rank_collapse.yaml"]
    assert rank.base.eval_at_init
    assert {"model.skip", "model.mlp", "model.n_layers"} <= set(rank.search_space)
    assert by_name["repro_stable_search.yaml"].constraints
