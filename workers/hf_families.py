"""The Hugging Face families qkscope builds (`model.kind: hf`), and what a request may set.

Torch- and transformers-free, so the API checks a study at POST without loading either. A
family is on the allow-list only with a row here: the config keys a request may set (each a
key `transformers`' config class of the family knows; tests/workers/test_hf_models.py checks
that against `AutoConfig.for_model`), and the names of its shape keys. The architecture
travels as data: nothing else reaches a worker, and `trust_remote_code` is never set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["HF_FAMILIES", "REFUSED_KEYS", "Family", "HFShape", "hf_config_errors", "hf_shape"]


@dataclass(frozen=True)
class Family:
    """One allow-listed `model_type`: its settable keys and the names of its shape keys."""

    keys: frozenset[str]
    width: str  # model width D
    layers: str
    heads: str
    kv_heads: str | None  # grouped-query heads (None: every head has its own key head)
    head_dim: str | None  # an explicit head width key (None: width / heads)
    ff: str  # the MLP's hidden width (GPT-2: n_inner, None there meaning 4 D)
    positions: str  # the longest sequence the model is built for
    rotary: bool
    defaults: dict[str, int]  # transformers' defaults of the shape keys (for the limits)


_DECODER = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "max_position_embeddings",
        "initializer_range",
        "rms_norm_eps",
        "rope_theta",
        "attention_dropout",
        "tie_word_embeddings",
    }
)
_LLAMA_DEFAULTS = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
}


def _decoder(extra: set[str], defaults: dict[str, int], head_dim: bool = True) -> Family:
    return Family(
        keys=_DECODER | extra | ({"head_dim"} if head_dim else set()),
        width="hidden_size",
        layers="num_hidden_layers",
        heads="num_attention_heads",
        kv_heads="num_key_value_heads",
        head_dim="head_dim" if head_dim else None,
        ff="intermediate_size",
        positions="max_position_embeddings",
        rotary=True,
        defaults=defaults,
    )


HF_FAMILIES: dict[str, Family] = {
    "llama": _decoder({"attention_bias", "mlp_bias"}, _LLAMA_DEFAULTS),
    "mistral": _decoder(
        {"sliding_window"},
        {**_LLAMA_DEFAULTS, "intermediate_size": 14336, "max_position_embeddings": 131072},
    ),
    "qwen3": _decoder(
        {"attention_bias", "sliding_window", "use_sliding_window"},
        {
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 32768,
        },
    ),
    "olmo2": _decoder({"attention_bias"}, _LLAMA_DEFAULTS, head_dim=False),
    "gpt2": Family(
        keys=frozenset(
            {
                "n_embd",
                "n_layer",
                "n_head",
                "n_inner",
                "n_positions",
                "activation_function",
                "resid_pdrop",
                "embd_pdrop",
                "attn_pdrop",
                "layer_norm_epsilon",
                "initializer_range",
                "scale_attn_weights",
                "scale_attn_by_inverse_layer_idx",
                "tie_word_embeddings",
            }
        ),
        width="n_embd",
        layers="n_layer",
        heads="n_head",
        kv_heads=None,
        head_dim=None,
        ff="n_inner",
        positions="n_positions",
        rotary=False,
        defaults={"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},  # n_inner: 4 D
    ),
}

REFUSED_KEYS: dict[str, str] = {
    "trust_remote_code": "qkscope never runs code that travels with a config",
    "auto_map": "qkscope never runs code that travels with a config",
    "attn_implementation": "qkscope trains on SDPA and probes through its own attention function",
    "vocab_size": "the vocabulary size comes from the task (task.vocab_size or the tokenizer)",
    "dtype": "the trial's dtype sets it",
    "torch_dtype": "the trial's dtype sets it",
}


def _int(config: Mapping[str, object], key: str, default: int | None) -> int | None:
    value = config.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def hf_config_errors(model_type: str, config: Mapping[str, object]) -> list[tuple[str, str]]:
    """What is wrong with a family's config, as (key, message) pairs; [] when nothing.

    Unknown family, refused or unknown keys, non-integer or non-positive shape keys, widths
    that the heads do not divide, query heads that the key heads do not divide, an odd rotary
    head width. `key` is "" for the model type itself.
    """
    family = HF_FAMILIES.get(model_type)
    if family is None:
        allowed = ", ".join(sorted(HF_FAMILIES))
        return [("", f"model_type {model_type!r} is not on the allow-list ({allowed})")]
    errors: list[tuple[str, str]] = []
    for key in config:
        if key in REFUSED_KEYS:
            errors.append((key, f"{key} is refused: {REFUSED_KEYS[key]}"))
        elif key not in family.keys:
            known = ", ".join(sorted(family.keys))
            errors.append((key, f"{model_type} has no settable config key {key!r} ({known})"))
    shape_keys = [family.width, family.layers, family.heads, family.positions, family.ff]
    shape_keys += [k for k in (family.kv_heads, family.head_dim) if k is not None]
    for key in shape_keys:
        value = config.get(key)
        if value is not None and _int(config, key, None) is None:
            errors.append((key, f"{key} must be an integer, got {value!r}"))
        elif isinstance(value, int) and value < 1:
            errors.append((key, f"{key} must be at least 1, got {value}"))
    if errors:
        return errors
    width = _int(config, family.width, family.defaults[family.width]) or 1
    heads = _int(config, family.heads, family.defaults[family.heads]) or 1
    head_dim = _int(config, family.head_dim, None) if family.head_dim else None
    if head_dim is None:
        if width % heads:
            errors.append(
                (
                    family.heads,
                    f"{family.width} ({width}) must be divisible by {family.heads} ({heads})",
                )
            )
            return errors
        head_dim = width // heads
    if family.kv_heads is not None:
        kv = _int(config, family.kv_heads, heads) or heads
        if heads % kv:
            errors.append(
                (
                    family.kv_heads,
                    f"{family.heads} ({heads}) must be divisible by {family.kv_heads} ({kv})",
                )
            )
    if family.rotary and head_dim % 2:
        errors.append(
            (
                family.head_dim if family.head_dim and family.head_dim in config else family.heads,
                f"rotary embeddings need an even head width; it is {head_dim}",
            )
        )
    return errors


@dataclass(frozen=True)
class HFShape:
    """The sizes of an allow-listed family's config that the limits and estimates read."""

    n_layers: int
    n_heads: int
    d_model: int
    d_ff: int
    positions: int
    gated_mlp: bool  # Llama-style gate/up/down (3 matrices) rather than GPT-2's 2


def hf_shape(model_type: str, config: Mapping[str, object]) -> HFShape:
    """The family's sizes from a config (transformers' defaults where it says nothing);
    numbers that are not integers count as 1 (the config check names them)."""
    family = HF_FAMILIES[model_type]

    def size(key: str) -> int:
        value = config.get(key, family.defaults.get(key, 1))
        if isinstance(value, bool) or not isinstance(value, int | float):
            return 1
        return max(1, int(value))

    width = size(family.width)
    has_ff = config.get(family.ff) is not None or family.ff in family.defaults
    ff = size(family.ff) if has_ff else 4 * width
    return HFShape(
        n_layers=size(family.layers),
        n_heads=size(family.heads),
        d_model=width,
        d_ff=ff,
        positions=size(family.positions),
        gated_mlp=model_type != "gpt2",
    )
