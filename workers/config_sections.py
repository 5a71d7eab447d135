"""The sections of a trial's config: its task, model, regularizer, optimizer and checkpoint
settings (`TrialConfig` in workers/config.py holds one of each); torch-free, like it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal, Self

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails

__all__ = [
    "BLOCK_PRESETS",
    "BYTE_VOCAB",
    "CAUSAL_ONLY_TASKS",
    "BlockPreset",
    "CheckpointConfig",
    "DataFormat",
    "HFModelSpec",
    "MAX_VOCAB_SIZE",
    "ModelConfig",
    "ModelSizes",
    "PLUGIN_GROUP",
    "PluginModelSpec",
    "installed_plugins",
    "OptimConfig",
    "RegularizerConfig",
    "RegularizerKind",
    "TaskConfig",
    "Tokenizer",
]

RegularizerKind = Literal["none", "spectral_variance", "locater"]
DataFormat = Literal["text", "bin", "dataset"]
Tokenizer = Literal["word", "char", "bytes", "bpe", "file"]
BYTE_VOCAB = 256
"""Ids of the bytes tokenizer (one per byte value), and the base alphabet of the byte BPE."""
MAX_VOCAB_SIZE = 4_000_000
"""The largest `task.vocab_size` a config states (the deployment's parameter and memory
limits bound it further at POST)."""

# Tasks whose targets are their own inputs at later positions (workers/tasks.py): lm predicts
# y[t] = x[t + 1] at every position; sort and copy predict each answer symbol b_i from the
# position before it, with b_i itself in the input. Without the causal mask every query would
# see the token it must predict, so `model.causal: false` is refused for them
# (`TrialConfig._mask_hides_the_targets`). associative_recall is not here: its one target is
# at the last position, with no later input, and the value it recalls sits earlier in the
# sequence, where the causal model sees it too.
CAUSAL_ONLY_TASKS: dict[str, str] = {
    "lm": "its targets are its inputs shifted by one (y[t] = x[t + 1])",
    "sort": "each answer symbol is the next input token (y[t] = x[t + 1] after the separator)",
    "copy": "each answer symbol is the next input token (y[t] = x[t + 1] after the separator)",
}


class TaskConfig(pydantic.BaseModel):
    """Which task a trial trains on and how its data is shaped.

    Fields that do not apply to the chosen ``kind`` are ignored (e.g. ``n_pairs`` for ``lm``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["lm", "associative_recall", "sort", "copy"] = "associative_recall"
    seq_len: int = Field(
        default=64, ge=4, le=4096, description="Tokens per example fed to the model."
    )
    # lm
    data_dir: str | None = Field(
        default=None,
        description=(
            "lm only: the directory of the splits (<train_split>.txt and <valid_split>.txt for "
            "format: text; .bin for bin; a dataset for dataset), relative to QKSCOPE_DATA_DIR."
        ),
    )
    data_root: str | None = Field(
        default=None,
        description=(
            "Set by the service, not by a study definition: the data directory "
            "(QKSCOPE_DATA_DIR) that data_dir and its split files must resolve inside when a "
            "trial opens them (a symlink made after the POST cannot lead out of it)."
        ),
    )
    train_split: str = Field(default="train", description="File stem of the training split.")
    valid_split: str = Field(default="valid", description="File stem of the validation split.")
    format: DataFormat = Field(
        default="text",
        description=(
            "lm only: how the splits are stored in data_dir. text: <split>.txt (UTF-8); "
            "bin: <split>.bin, token ids as a flat array of token_dtype (nanoGPT's "
            "train.bin / val.bin), already tokenized; dataset: a local Parquet, JSONL or "
            "save_to_disk dataset whose text_column holds the text (docs/your-data.md)."
        ),
    )
    tokenizer: Tokenizer = Field(
        default="word",
        description=(
            "lm on text or a dataset: word (whitespace words, <eos> per line) or char, the "
            "vocab_cap most frequent from the training split; bytes (UTF-8 bytes, 256 ids); "
            "bpe (a byte-level BPE of vocab_size tokens trained on the training split, "
            "cached); file (the Hugging Face tokenizers JSON tokenizer_file). Not for bin."
        ),
    )
    vocab_cap: int = Field(
        default=10000,
        ge=16,
        le=1_000_000,
        description="Most frequent tokens kept; rest map to <unk> (word and char only).",
    )
    vocab_size: int | None = Field(
        default=None,
        ge=2,
        le=MAX_VOCAB_SIZE,
        description=(
            "The model's vocabulary: every token id is below it. Required for bpe (the size "
            "the BPE is trained to), file (at least the tokenizer's size) and bin (above "
            "every id in the files); bytes: 256 unless given; word and char count theirs "
            "(vocab_cap)."
        ),
    )
    tokenizer_file: str = Field(
        default="tokenizer.json",
        max_length=1000,
        description="tokenizer: file only: the tokenizers JSON, relative to data_dir.",
    )
    token_dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="format: bin only: the dtype of the ids in the files."
    )
    text_column: str = Field(
        default="text",
        min_length=1,
        max_length=200,
        description="format: dataset only: the column that holds the text.",
    )
    max_train_tokens: int | None = Field(
        default=None, ge=1000, description="Optional truncation of the training split (fast tests)."
    )
    # synthetic
    n_symbols: int = Field(
        default=16, ge=2, le=4096, description="Alphabet size of synthetic tasks."
    )
    n_pairs: int = Field(
        default=8, ge=1, le=512, description="associative_recall: pairs per example."
    )
    n_valid: int = Field(
        default=256,
        ge=8,
        le=100_000,
        description="Synthetic validation examples (fixed, from seed).",
    )

    @pydantic.model_validator(mode="after")
    def _check_layout(self) -> Self:
        """Reject combinations that cannot produce a well-formed example."""
        if self.kind == "lm":
            if self.data_dir is None:
                raise ValueError("data_dir is required when kind='lm'")
            for name in ("train_split", "valid_split"):
                stem: str = getattr(self, name)
                if not stem or "/" in stem or "\\" in stem or stem in (".", ".."):
                    raise ValueError(f"{name} must be a plain file stem, got {stem!r}")
            self._check_data_form()
        elif self.kind == "associative_recall":
            if self.n_pairs > self.n_symbols:
                raise ValueError(
                    f"n_pairs ({self.n_pairs}) must be <= n_symbols ({self.n_symbols}) "
                    "so that the keys of one example are distinct"
                )
            need = 2 * self.n_pairs + 2
            if self.seq_len < need:
                raise ValueError(
                    f"seq_len ({self.seq_len}) must be >= 2 * n_pairs + 2 = {need} "
                    "for associative_recall"
                )
        else:  # sort / copy: L = (seq_len - 1) // 2 symbols, a separator, L symbols
            if (self.seq_len - 1) // 2 < 1:
                raise ValueError(f"seq_len ({self.seq_len}) must be >= 3 for {self.kind}")
        return self

    def _check_data_form(self) -> None:
        """The lm data form's own fields (docs/your-data.md), each refusal located at the
        field to change (a 422 at base.task.<field> in a study)."""
        name, v = type(self).__name__, self.vocab_size
        if self.format == "bin" and self.tokenizer != "word":
            raise _refuse(
                name,
                ("tokenizer",),
                self.tokenizer,
                "format: bin holds token ids already: leave tokenizer out (it is not used)",
            )
        fixed = self.format == "bin" or self.tokenizer in ("bpe", "file")
        if fixed and v is None:
            what = "format: bin" if self.format == "bin" else f"tokenizer: {self.tokenizer}"
            raise _refuse(
                name,
                ("vocab_size",),
                v,
                f"{what} needs vocab_size, the model's vocabulary (every token id is below it)",
            )
        if self.format != "bin" and self.tokenizer in ("word", "char") and v is not None:
            raise _refuse(
                name,
                ("vocab_size",),
                v,
                f"tokenizer: {self.tokenizer} counts its vocabulary from the training split "
                "(vocab_cap most frequent tokens and <unk>); leave vocab_size out, or use "
                "tokenizer: bpe, bytes or file",
            )
        text_bytes = self.format != "bin" and self.tokenizer in ("bpe", "bytes")
        if text_bytes and v is not None and v < BYTE_VOCAB:
            raise _refuse(
                name,
                ("vocab_size",),
                v,
                f"tokenizer: {self.tokenizer} needs vocab_size >= {BYTE_VOCAB} "
                "(the 256 byte values are its base alphabet)",
            )
        if self.format == "bin" and self.token_dtype == "uint16" and v is not None and v > 2**16:
            raise _refuse(
                name,
                ("token_dtype",),
                self.token_dtype,
                f"uint16 holds ids below 65536, and vocab_size is {v}: use token_dtype: uint32",
            )
        if self.format != "bin" and self.tokenizer == "file":
            path = PurePosixPath(self.tokenizer_file)
            f = self.tokenizer_file
            if not f or path.is_absolute() or f.startswith("~") or ".." in path.parts:
                raise _refuse(
                    name,
                    ("tokenizer_file",),
                    f,
                    "must be a relative path inside data_dir (no leading '/' or '~', no '..')",
                )
            if "\\" in f or "\x00" in f:
                raise _refuse(name, ("tokenizer_file",), f, "must be a plain relative path")

    @property
    def fixed_vocab_size(self) -> int | None:
        """The model's vocabulary when the config fixes it (lm with format bin or tokenizer
        bytes, bpe or file: `vocab_size`, bytes 256 unless given), else None: word and char
        count it from the training split, the synthetic tasks from their symbols."""
        if self.kind != "lm":
            return None
        if self.format == "bin" or self.tokenizer in ("bpe", "file"):
            return self.vocab_size
        if self.tokenizer == "bytes":
            return BYTE_VOCAB if self.vocab_size is None else self.vocab_size
        return None


def _refuse(cls_name: str, loc: tuple[str, ...], value: object, msg: str) -> ValidationError:
    """A ValidationError located at `loc` (relative to the model raising it), so a study spec
    names the field that is refused (e.g. base.model.position), not the whole section."""
    detail = InitErrorDetails(
        type="value_error", loc=loc, input=value, ctx={"error": ValueError(msg)}
    )
    return ValidationError.from_exception_data(cls_name, [detail])


HFValue = bool | int | float | str


@dataclass(frozen=True)
class ModelSizes:
    """A model's sizes as the parameter, memory and FLOP estimates read them."""

    n_layers: int
    n_heads: int
    d_model: int
    d_ff: int
    mlp_matrices: int  # weight matrices of d_model x d_ff per MLP (0: no MLP)


class HFModelSpec(BaseModel):
    """`model.hf`: a Hugging Face `transformers` family from the allow-list, built from a config
    (workers/hf_families.py; docs/bring-your-model.md). Nothing but this data reaches a
    worker: no code, no download, never `trust_remote_code`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_type: str = Field(
        description="The family: llama, qwen3, olmo2, mistral or gpt2.",
    )
    config: dict[str, HFValue] = Field(
        default_factory=dict,
        description=(
            "Keys of the family's transformers config (hidden_size, num_hidden_layers, "
            "num_attention_heads, num_key_value_heads, rope_theta, ...; GPT-2: n_embd, n_layer, "
            "n_head, ...); the rest keep transformers' defaults. Each key is searchable as "
            "model.hf.config.<key>. vocab_size comes from the task."
        ),
    )

    @model_validator(mode="after")
    def _known_family_and_keys(self) -> Self:
        from workers.hf_families import hf_config_errors

        for key, msg in hf_config_errors(self.model_type, self.config):
            loc = ("config", key) if key else ("model_type",)
            raise _refuse(type(self).__name__, loc, self.config.get(key, self.model_type), msg)
        return self


PLUGIN_GROUP = "qkscope.models"
"""The entry-point group a model plug-in registers its factory in."""


def installed_plugins() -> list[str]:
    """The names of the installed model plug-ins (entry points of PLUGIN_GROUP; nothing is
    imported)."""
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group=PLUGIN_GROUP))


class PluginModelSpec(BaseModel):
    """`model.plugin`: a model from an installed package's `qkscope.models` entry point
    (docs/bring-your-model.md). Only the name and this data travel over REST."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(max_length=200, description="The entry point's name.")
    config: dict[str, HFValue] = Field(
        default_factory=dict,
        description="Passed to the plug-in's factory; each key searchable as "
        "model.plugin.config.<key>.",
    )

    @model_validator(mode="after")
    def _installed(self) -> Self:
        names = installed_plugins()
        if self.name not in names:
            listed = ", ".join(names) or "none installed"
            raise _refuse(
                type(self).__name__,
                ("name",),
                self.name,
                f"no model plug-in {self.name!r} in the {PLUGIN_GROUP} entry points ({listed})",
            )
        return self


BlockPreset = Literal["custom", "pure", "attn_mlp", "attn_mlp_skip", "attn_skip", "full"]
# (skip, mlp, mlp_skip) of each named variant of Dong et al. 2021. "attn_mlp" is attention + MLP
# with no residual anywhere; "attn_mlp_skip" is the variant of the authors' code
# (twistedcubic/attention-rank-collapse, walking_casual_transformers.ipynb): the residual around
# attention is removed but the MLP sublayer keeps its own.
BLOCK_PRESETS: dict[str, tuple[bool, bool, bool]] = {
    "pure": (False, False, False),
    "attn_mlp": (False, True, False),
    "attn_mlp_skip": (False, True, True),
    "attn_skip": (True, False, True),
    "full": (True, True, True),
}


class ModelConfig(BaseModel):
    """Architecture of one trial's model (vocabulary and context come from the task)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["builtin", "hf", "plugin"] = Field(
        "builtin",
        description=(
            "builtin: qkscope's own model (the fields below). hf: a Hugging Face transformers "
            "family built from `hf` (the builtin fields below are then unused; "
            "docs/bring-your-model.md). plugin: an installed package's model (`plugin`)."
        ),
    )
    plugin: PluginModelSpec | None = Field(
        None, description="With kind: plugin, the plug-in and its config."
    )
    hf: HFModelSpec | None = Field(
        None, description="With kind: hf, the family and its config (docs/bring-your-model.md)."
    )
    n_layers: int = Field(2, ge=1, le=64)
    n_heads: int = Field(2, ge=1, le=64)
    d_model: int = Field(64, ge=4, le=8192)
    d_ff: int = Field(256, ge=4, le=32768)
    # A width rule, for a study over d_model (a width ladder, METRICS.md section 11): the
    # other shapes follow the width instead of staying fixed.
    d_ff_ratio: float | None = Field(
        None,
        gt=0.0,
        le=64.0,
        description="Width rule: d_ff = round(d_ff_ratio * d_model) (Llama's SwiGLU: 8/3), "
        "overriding d_ff; None: d_ff as given.",
    )
    head_dim: int | None = Field(
        None,
        ge=1,
        le=8192,
        description="Width rule: heads of fixed width, n_heads = d_model / head_dim "
        "(overriding n_heads; d_model must be a multiple); None: n_heads as given.",
    )
    norm: Literal["pre", "post", "none"] = "pre"
    skip: bool = True  # residual connection around attention (and the MLP unless mlp_skip says)
    mlp: bool = True
    mlp_skip: bool | None = None  # residual around the MLP; None = the same as `skip`
    # A named Dong et al. variant; anything but "custom" sets skip, mlp and mlp_skip.
    block: BlockPreset = "custom"
    qk_norm: Literal["none", "layernorm", "rmsnorm", "sigma_reparam"] = Field(
        "none",
        description=(
            "Normalisation of the queries and keys per head before the logits: LayerNorm or "
            "RMSNorm (each with a learned scale; LayerNorm also a bias), or sigma-reparam of "
            "the query and key projections (Zhai et al. 2023)."
        ),
    )
    norm_type: Literal["layernorm", "rmsnorm"] = Field(
        "layernorm",
        description=(
            "The block and final norms (wherever `norm` puts one): LayerNorm, or RMSNorm "
            "(torch.nn.RMSNorm: a learned scale, no bias, no mean subtraction; Llama)."
        ),
    )
    position: Literal["learned", "rotary"] = Field(
        "learned",
        description=(
            "Position information: a learned embedding added to the tokens (GPT-2), or rotary "
            "embeddings (RoPE, base 10000, the rotate-half form) applied to q and k of every "
            "head after the QK norm (Llama); needs an even head width."
        ),
    )
    mlp_type: Literal["gelu", "swiglu"] = Field(
        "gelu",
        description=(
            "The MLP: proj(gelu(fc x)), or SwiGLU proj(silu(gate x) * (up x)) with gate and up "
            "of width d_ff each (one fc of 2 d_ff outputs; 1.5x the parameters of gelu at the "
            "same d_ff: Llama uses d_ff = 8/3 d_model)."
        ),
    )
    sigma_reparam: Literal["none", "all"] = Field(
        "none",
        description=(
            "all: every linear layer of every block (q, k, v, output, MLP) is "
            "W_hat = gamma / sigma(W) * W, sigma by one power iteration a training step, gamma "
            "learned and initialised to sigma(W) (Zhai et al. 2023). The query/key-only "
            "variant is qk_norm: sigma_reparam."
        ),
    )
    qk_init_std: float = Field(0.02, gt=0.0, le=10.0)
    mlp_init_std: float = Field(
        0.02,
        gt=0.0,
        le=1.0,
        description=(
            "Init std of both MLP weight matrices (fc and proj); every other weight but the "
            "query/key projections keeps 0.02 (GPT). At 0.02 the MLP is nearly linear and "
            "small next to its input (pre-activations ~0.02 sqrt(d_model)); about "
            "1/sqrt(d_model) puts GELU in its non-linear regime and the MLP's output on the "
            "scale of its input; the MLP's Lipschitz constant at init grows as "
            "mlp_init_std^2 (large values: the regime of Dong et al.'s claim that MLPs slow "
            "rank collapse). An init scale only: per trial, fusable."
        ),
    )
    init_scheme: Literal["gpt", "token_scale"] = Field(
        "gpt",
        description=(
            "gpt: every weight std 0.02 but the QK and MLP scales above (nanoGPT). "
            "token_scale: the same draws rescaled so that attention keeps the token scale "
            "without any LayerNorm (Dong et al.'s pure self-attention network): token and "
            "position embeddings std 1/sqrt(2) (their sum has unit-variance entries, the "
            "scale a LayerNorm would give), value and output projections std 1/sqrt(d_model) "
            "(W_O W_V keeps a token's norm in expectation); the QK and MLP scales are "
            "unchanged. With norm none, the logits of every layer then see tokens of norm "
            "about sqrt(d_model), where GPT init shrinks them by ~0.013 a layer. An init "
            "scale only: per trial, fusable."
        ),
    )
    qkv_init: Literal["normal", "fairseq"] = Field(
        "normal",
        description=(
            "normal: q and k drawn with std qk_init_std, v with 0.02 (GPT). fairseq: "
            "fairseq's MultiheadAttention init (Bao et al.'s model): q, k and v "
            "xavier_uniform with gain 1/sqrt(2) (std 1/sqrt(2 d_model) for square "
            "projections, 0.0625 at d_model 128, ~3 x the 0.02 draw, so W_QK starts ~10 x "
            "larger) and the output projection xavier_uniform with gain 1; drawn after every "
            "other weight, so the rest of the model is the normal draw. Refused with a "
            "qk_init_std other than 0.02 (both set the query/key scale)."
        ),
    )
    embed_scale: Literal["none", "sqrt_d"] = Field(
        "none",
        description=(
            "none: the token embedding enters as drawn (GPT, std 0.02). sqrt_d: fairseq's "
            "token embedding (Bao et al.'s model): drawn with std 1/sqrt(d_model) (the 0.02 "
            "draw rescaled, nothing more drawn) and multiplied by sqrt(d_model) on the way "
            "in, so its entries have unit scale; the tied output head uses the unscaled "
            "weight, as fairseq's shared decoder embedding does. Learned positions (std "
            "0.02) are added after the scaling, as fairseq adds its sinusoidal ones. "
            "Refused with init_scheme: token_scale (both set the token scale)."
        ),
    )
    attn_temperature: float = Field(1.0, gt=0.0, le=100.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    causal: bool = Field(
        True,
        description=(
            "Causal mask on attention (a decoder). false: bidirectional attention, every "
            "query sees every key, as in Dong et al.'s theorem and the authors' BERT; only "
            "sound for a task whose targets are not among its inputs at later positions "
            "(associative recall: the one target is at the last position), and refused for "
            "lm, sort and copy, where every query would see its answer. Probes then "
            "normalise by n_i = S keys (docs/metrics.md sections 1, 7)."
        ),
    )

    @model_validator(mode="after")
    def _apply_block_preset(self) -> ModelConfig:
        if self.block != "custom":
            self.skip, self.mlp, self.mlp_skip = BLOCK_PRESETS[self.block]
        return self

    def sizes(self) -> ModelSizes:
        """The sizes the limits and estimates read, whatever the kind (an hf config's from
        its family's keys; works on an unvalidated `model_construct` copy too)."""
        if self.kind == "hf" and self.hf is not None:
            from workers.hf_families import HF_FAMILIES, hf_shape

            hf = (
                self.hf
                if isinstance(self.hf, HFModelSpec)
                else HFModelSpec.model_construct(**dict(self.hf))
            )
            if hf.model_type not in HF_FAMILIES:  # an unvalidated copy: the check names it
                return ModelSizes(self.n_layers, self.n_heads, self.d_model, self.d_ff, 2)
            shape = hf_shape(hf.model_type, hf.config)
            mats = 3 if shape.gated_mlp else 2
            return ModelSizes(shape.n_layers, shape.n_heads, shape.d_model, shape.d_ff, mats)
        mats = (3 if self.mlp_type == "swiglu" else 2) if self.mlp else 0
        return ModelSizes(self.n_layers, self.n_heads, self.d_model, self.d_ff, mats)

    @property
    def mlp_residual(self) -> bool:
        """Whether the MLP sublayer adds its input back (its own skip connection)."""
        return self.skip if self.mlp_skip is None else self.mlp_skip

    @model_validator(mode="after")
    def _apply_width_rule(self) -> ModelConfig:
        if self.d_ff_ratio is not None:
            self.d_ff = max(4, round(self.d_ff_ratio * self.d_model))
        if self.head_dim is not None:
            if self.d_model % self.head_dim != 0:
                raise ValueError(
                    f"d_model ({self.d_model}) must be a multiple of head_dim ({self.head_dim})"
                )
            self.n_heads = self.d_model // self.head_dim
        return self

    @model_validator(mode="after")
    def _kind_has_its_section(self) -> ModelConfig:
        name = type(self).__name__
        for kind in ("hf", "plugin"):
            section = getattr(self, kind)
            if self.kind == kind and section is None:
                raise _refuse(name, (kind,), None, f"kind: {kind} needs model.{kind}")
            if self.kind != kind and section is not None:
                raise _refuse(name, (kind,), "...", f"model.{kind} is only read with kind: {kind}")
        if self.kind != "builtin":  # the built-in model's fields mean nothing to another
            for field_name, field in type(self).model_fields.items():
                value = getattr(self, field_name)
                if field_name not in ("kind", "hf", "plugin") and value != field.default:
                    raise _refuse(
                        name,
                        (field_name,),
                        value,
                        f"model.{field_name} is a setting of the built-in model, not read with "
                        f"kind: {self.kind}; set the model's own key under "
                        f"model.{self.kind}.config",
                    )
        return self

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        return self

    @model_validator(mode="after")
    def _options_fit_together(self) -> ModelConfig:
        """Refuse option combinations that mean nothing or cannot be built, naming the
        option that is refused (a 422 at base.model.<field> in a study)."""
        name = type(self).__name__
        if self.position == "rotary" and self.d_head % 2 != 0:
            raise _refuse(
                name,
                ("position",),
                self.position,
                f"position: rotary needs an even head width; d_model / n_heads = {self.d_head}",
            )
        if self.sigma_reparam == "all" and self.qk_norm == "sigma_reparam":
            raise _refuse(
                name,
                ("sigma_reparam",),
                self.sigma_reparam,
                "sigma_reparam: all already reparametrises the query and key projections; "
                "use qk_norm: none (or layernorm/rmsnorm) with it, or qk_norm: sigma_reparam "
                "alone for the query/key-only variant",
            )
        if self.qkv_init == "fairseq" and self.qk_init_std != 0.02:
            raise _refuse(
                type(self).__name__,
                ("qkv_init",),
                self.qkv_init,
                "qkv_init: fairseq sets the query/key init itself; leave qk_init_std at 0.02",
            )
        if self.embed_scale != "none" and self.init_scheme == "token_scale":
            raise _refuse(
                name,
                ("embed_scale",),
                self.embed_scale,
                "embed_scale: sqrt_d sets the token scale itself (fairseq's embedding); "
                "use it with init_scheme: gpt, or init_scheme: token_scale with embed_scale: "
                "none",
            )
        if self.norm_type == "rmsnorm" and self.norm == "none":
            raise _refuse(
                name,
                ("norm_type",),
                self.norm_type,
                "norm_type: rmsnorm with norm: none has no norm to make an RMSNorm; "
                "use norm: pre or post",
            )
        if self.mlp_type == "swiglu" and not self.mlp:
            raise _refuse(
                name,
                ("mlp_type",),
                self.mlp_type,
                "mlp_type: swiglu with no MLP (mlp: false, or a block preset without one)",
            )
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


class RegularizerConfig(BaseModel):
    """The eigenspectrum penalty added to the task loss (docs/metrics.md section 4)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    kind: RegularizerKind = "none"
    lam: float = Field(0.0, ge=0.0, le=1e6, alias="lambda")
    target_mean: float = Field(
        0.0,
        ge=-1e3,
        le=1e3,
        description=(
            "locater only: the t of var + (mean - t)^2, the mean over D eigenvalues of "
            "(lambda_i - t)^2. It holds the eigen-mean over the head's rank, tr(W)/d_h "
            "(`qk_eig_mean_rank`), at t; the D-mean tr(W)/D (`qk_eig_mean`) is held at "
            "t * d_h / D (t itself only for one full-width head, d_h = D; two heads: t / 2). "
            "t = 0 is plain shrinkage of W's symmetric part (docs/metrics.md section 4)."
        ),
    )


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0.0, le=10.0)
    weight_decay: float = Field(0.0, ge=0.0, le=10.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "cosine"
    min_lr: float | None = Field(
        None,
        ge=0.0,
        le=10.0,
        description=(
            "cosine only: the learning rate the cosine reaches at the last step (Wortsman et "
            "al. 2024 decay to 1e-5), never above the peak `lr`. None keeps the old schedule, "
            "a cosine to 0.1 x the peak, so studies defined before this field run unchanged."
        ),
    )
    grad_clip: float | None = Field(1.0, gt=0.0)
    weight_decay_mode: Literal["coupled", "independent"] = Field(
        "coupled",
        description=(
            "AdamW's decay step: coupled (torch's AdamW) decays p by lr * weight_decay * p, "
            "where lr includes its schedule; independent (Wortsman et al. 2023) by "
            "weight_decay * schedule_multiplier * p, so the decay does not grow with the "
            "learning rate (weight_decay ~1e-4 there, not ~0.1). adamw only."
        ),
    )

    @model_validator(mode="after")
    def _independent_decay_is_adamw(self) -> OptimConfig:
        if self.weight_decay_mode == "independent" and self.name != "adamw":
            raise _refuse(
                type(self).__name__,
                ("weight_decay_mode",),
                self.weight_decay_mode,
                f"weight_decay_mode: independent is an AdamW option; optim.name is {self.name!r}",
            )
        return self

    @property
    def torch_weight_decay(self) -> float:
        """The weight decay to give torch's AdamW (which decays by lr * wd): `weight_decay`
        when coupled; `weight_decay / lr` when independent, so that lr * wd is
        weight_decay times the schedule's multiplier."""
        if self.weight_decay_mode == "independent":
            return self.weight_decay / self.lr
        return self.weight_decay


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dir: str | None = None  # where checkpoints go; None = no checkpoints
    every_evals: int = Field(1, ge=1)
    # Who the directory belongs to (set by the study runner): a directory left by another run
    # is emptied before it is read (workers/checkpoints.py). None = not checked.
    owner: str | None = None
