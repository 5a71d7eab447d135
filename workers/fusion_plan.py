"""Which trials can train together as one fused model, and in which groups; torch-free.

The runner groups the trials it asks Optuna for without loading torch (the trial processes
do); `workers.fused` trains the groups and re-exports these names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from workers.config import TrialConfig

__all__ = ["PER_MEMBER_FIELDS", "FusionError", "check_fusable", "fusion_key", "group_by_key"]

# Fields that may differ between members; everything else must be equal (the fusion key).
PER_MEMBER_FIELDS: dict[str, tuple[str, ...]] = {
    "": (
        "seed",
        "regularizer",
        "checkpoint",
        "entropy_collapse_threshold",
        "rank_collapse_threshold",
        "plateau_window",
        "plateau_rel_tol",
        "trapped_rel_gap",
    ),
    "optim": ("lr", "weight_decay", "beta1", "beta2", "grad_clip"),
    "model": ("qk_init_std", "attn_temperature"),
}


class FusionError(ValueError):
    """A config that cannot be trained as a fused member (names the field)."""


def check_fusable(config: TrialConfig) -> None:
    """Refuse what the fused model cannot reproduce exactly."""
    if config.model.dropout > 0.0:
        raise FusionError(
            "model.dropout: fused trials draw no randomness in the forward, so dropout > 0 "
            "cannot match the trial run alone; use fuse: 1"
        )
    if config.model.qk_norm == "sigma_reparam":
        raise FusionError(
            "model.qk_norm: sigma_reparam updates per-module buffers in the training forward "
            "and is not fused; use fuse: 1"
        )


def fusion_key(config: TrialConfig) -> str:
    """The fields that shape the fused program (architecture, data shapes, loop): JSON."""
    data = config.model_dump(mode="json", by_alias=True)
    for section, names in PER_MEMBER_FIELDS.items():
        node = data[section] if section else data
        for name in names:
            node.pop(name, None)
    return json.dumps(data, sort_keys=True)


def group_by_key(configs: Sequence[TrialConfig], max_size: int) -> list[list[int]]:
    """Indices of `configs` in groups of equal `fusion_key`, at most `max_size` each.

    Groups keep the order of first appearance; configs that cannot be fused get a group of
    their own.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    open_groups: dict[str, list[int]] = {}
    groups: list[list[int]] = []
    for i, cfg in enumerate(configs):
        try:
            check_fusable(cfg)
        except FusionError:
            groups.append([i])
            continue
        key = fusion_key(cfg)
        group = open_groups.get(key)
        if group is None or len(group) >= max_size:
            group = open_groups[key] = []
            groups.append(group)
        group.append(i)
    return groups
