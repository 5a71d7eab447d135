"""Models the trial engine trains, behind one protocol (`QKModel`, workers/models/base.py).

`model.kind` picks the builder: `builtin` (workers/model.py's GPT, the default) or `hf` (a
Hugging Face `transformers` family from an allow-list, built from a config:
workers/models/hf.py) or `plugin` (an installed package's `qkscope.models` entry point:
workers/models/plugin.py). Builders are imported lazily: `transformers` loads only for hf trials.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.models.base import ProbeOutput, QKModel

if TYPE_CHECKING:
    from workers.config import ModelConfig

__all__ = ["ProbeOutput", "QKModel", "build"]


def build(cfg: ModelConfig, vocab_size: int, seq_len: int) -> QKModel:
    """The model `cfg.kind` names, freshly initialised from torch's current RNG state."""
    if cfg.kind == "hf":
        from workers.models.hf import HFModel

        assert cfg.hf is not None  # ModelConfig refuses kind hf without its section
        return HFModel(cfg.hf, vocab_size=vocab_size, seq_len=seq_len)
    if cfg.kind == "plugin":
        from workers.models.plugin import build_plugin

        assert cfg.plugin is not None
        return build_plugin(cfg.plugin.name, dict(cfg.plugin.config), vocab_size, seq_len)
    from workers.model import GPT

    return GPT(cfg, vocab_size=vocab_size, seq_len=seq_len)
