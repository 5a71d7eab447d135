"""`model.kind: plugin`: a model from an installed package (docs/bring-your-model.md).

A plug-in is a package installed on the workers (and the API, which checks the name at POST)
with an entry point in the `qkscope.models` group naming a factory
`(config: dict, vocab_size: int, seq_len: int) -> QKModel`. Only the entry point's name and
the config, data, travel over REST; no code does. examples/qkscope-example-model is a worked
example.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from workers.config_sections import PLUGIN_GROUP
from workers.models.base import QKModel

__all__ = ["build_plugin"]


def build_plugin(name: str, config: dict[str, Any], vocab_size: int, seq_len: int) -> QKModel:
    """The plug-in's model, from torch's current RNG state; a ValueError names what is wrong
    (not installed here, or a factory that does not give a QKModel)."""
    found = list(entry_points(group=PLUGIN_GROUP, name=name))
    if not found:
        raise ValueError(f"model.plugin.name: no {PLUGIN_GROUP} entry point {name!r} installed")
    model = found[0].load()(config, vocab_size=vocab_size, seq_len=seq_len)
    if not isinstance(model, QKModel):
        raise ValueError(
            f"model.plugin {name!r} gave a {type(model).__name__}, not a workers.models.QKModel"
        )
    return model
