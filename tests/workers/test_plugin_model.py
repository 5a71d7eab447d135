"""`model.kind: plugin` with the worked example (examples/qkscope-example-model), installed
into the test environment as a user installs a plug-in: `pip install` of the package, whose
entry point in `qkscope.models` the workers find by name."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.workers.helpers import REPO, TINY, merge
from workers.config import TrialConfig
from workers.evaluation import probe_metrics
from workers.trial import run_trial

EXAMPLE = REPO / "examples" / "qkscope-example-model"
NAME = "tiny-attention"


@pytest.fixture(scope="module")
def example_installed() -> None:
    """The example installed (editable, no dependencies, offline) unless it already is."""
    if not list(entry_points(group="qkscope.models", name=NAME)):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
             "-e", str(EXAMPLE)],
            check=True,
        )  # fmt: skip
    src = str(EXAMPLE)  # this process started before the install: its path, as the .pth gives
    if src not in sys.path:
        sys.path.append(src)


def _config(**over: object) -> TrialConfig:
    model = {"kind": "plugin", "plugin": {"name": NAME, "config": {"n_layers": 2, "n_heads": 2}}}
    data = merge(TINY, dict(over))
    data["model"] = model
    return TrialConfig.model_validate(data)


def test_unknown_plugin_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="no model plug-in 'nope'") as e:
        TrialConfig.model_validate({"model": {"kind": "plugin", "plugin": {"name": "nope"}}})
    assert "plugin" in str(e.value) and "name" in str(e.value)


def test_plugin_trains_and_its_probes_match_numpy(example_installed: None, tmp_path: Path) -> None:
    summary = run_trial(
        _config(steps=4, eval_every=2, regularizer={"kind": "locater", "lambda": 0.1})
    )
    assert summary.status == "completed" and summary.final_val_loss is not None
    assert summary.qk_eig_var is not None

    from workers.models import build

    torch.manual_seed(0)
    model = build(_config().model, vocab_size=20, seq_len=16).double()
    x = torch.randint(0, 20, (2, 16))
    by = {(p.name, p.layer, p.head): p.value for p in probe_metrics(model, x)}
    block = model.blocks[0]
    w = block.qkv.weight.detach().numpy()
    d, d_h = w.shape[1], block.d_head
    for h in range(2):  # W_h = w_q,h^T w_k,h / sqrt(d_h) from the fused rows
        wq, wk = w[h * d_h : (h + 1) * d_h], w[d + h * d_h : d + (h + 1) * d_h]
        form = wq.T @ wk / np.sqrt(d_h)
        ev = np.linalg.eigvalsh((form + form.T) / 2)
        assert by[("qk_eig_mean", 1, h)] == pytest.approx(np.trace(form) / d, rel=1e-9)
        assert by[("qk_eig_var", 1, h)] == pytest.approx(ev.var(), rel=1e-9)
