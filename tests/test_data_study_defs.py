"""Each `study_defs/data_*.yaml` (one per data form of docs/your-data.md) is runnable as its
comments say: on a data root that scripts/data_forms.py wrote from the real WikiText-2 (its
first lines, for speed), the API's file checks accept it, and its base trial trains at
reduced size on the CPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from service.spec import check_data_files, parse_spec
from tests.data_helpers import ROOT, WIKITEXT, data_forms, text_dir, wikitext
from workers.config import TrialConfig
from workers.data.cache import CACHE_ENV
from workers.tasks import clear_corpus_cache

DEFS = sorted((ROOT / "study_defs").glob("data_*.yaml"))
pytestmark = pytest.mark.skipif(not WIKITEXT.is_dir(), reason="WikiText-2 not available")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root as a user makes it: wikitext-2/ and the forms the script writes."""
    out = tmp_path_factory.mktemp("data")
    source = text_dir(out / "wikitext-2", valid=wikitext("valid", 2000), test=wikitext("test", 600))
    data_forms().write_all(source, out, ["valid", "test"], 4096)
    return out


def test_one_definition_per_data_form() -> None:
    forms = set()
    for path in DEFS:
        task = parse_spec(path.read_bytes(), "application/yaml").base.task
        forms.add((task.format, task.tokenizer if task.format != "bin" else "-"))
    assert {("text", "bpe"), ("text", "bytes"), ("text", "file"), ("bin", "-")} <= forms
    assert any(f == "dataset" for f, _ in forms)


@pytest.mark.parametrize("path", DEFS, ids=[p.name for p in DEFS])
def test_data_definition_passes_the_checks_and_trains(
    path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.trial import run_trial

    monkeypatch.setenv(CACHE_ENV, str(root / "cache"))  # one BPE for the definitions
    spec = parse_spec(path.read_bytes(), "application/yaml")
    assert check_data_files(spec, str(root)) == []
    data: dict[str, Any] = spec.base.model_dump(mode="json", by_alias=True)
    data["task"]["data_dir"] = str(root / data["task"]["data_dir"])
    data.update(steps=3, eval_every=3, eval_batches=1, batch_size=4, device="cpu")
    data["optim"]["warmup_steps"] = 1
    clear_corpus_cache()
    summary = run_trial(TrialConfig.model_validate(data))
    assert summary.status == "completed" and summary.steps_done == 3
    assert summary.final_val_loss is not None and math.isfinite(summary.final_val_loss)
    vocab = spec.base.task.fixed_vocab_size
    assert vocab is not None  # every data definition states or fixes its vocabulary
    assert abs(summary.final_val_loss - math.log(vocab)) < 1.0  # about uniform after 3 steps
