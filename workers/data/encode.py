"""Text to token ids for the bytes, bpe and file tokenizers (docs/your-data.md); torch-free.

A text is tokenized line by line: each line with its newline is encoded alone (no special
tokens added) and the ids are concatenated, so what a line gives does not depend on the
lines around it, and a byte-level tokenizer decodes the ids back to the exact text.

- bytes: the UTF-8 bytes, one id per byte (0-255).
- bpe: a byte-level BPE (GPT-2's pre-tokenizer, the 256 byte values as its base alphabet, no
  special tokens) trained with Hugging Face `tokenizers` on the training split's lines to
  `vocab_size` tokens; deterministic for one text, size and `tokenizers` version, and cached
  under that content hash (workers/data/cache.py), so trials on one corpus train it once.
- file: the user's `tokenizers` JSON file (`tokenizer.json`), loaded as it is.

Encoded splits are cached too (by the text's hash and the tokenizer's JSON) and read back
memory-mapped. `tokenizers` is imported only here, and only for bpe and file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from workers.data.cache import content_key, locked, write_atomic

__all__ = [
    "BPE_VERSION",
    "ENCODE_LINES",
    "bytes_ids",
    "encode_text",
    "lines",
    "text_sha",
    "train_bpe",
    "trained_bpe",
]

BPE_VERSION = 1
"""The recipe of `train_bpe`: part of the cache key, raised whenever the recipe changes."""

ENCODE_LINES = 8192
"""Lines given to `Tokenizer.encode_batch` at once (it encodes them in parallel)."""


def lines(text: str) -> Iterator[str]:
    """The lines of `text`, each with its newline ("\\n" only; the last one without, when the
    text does not end with one); concatenated they are `text`."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        if end < 0:
            yield text[start:]
            return
        yield text[start : end + 1]
        start = end + 1


def text_sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def bytes_ids(text: str) -> np.ndarray:
    """The bytes tokenizer: the text's UTF-8 bytes as ids (uint8, 0-255)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def train_bpe(text: str, vocab_size: int) -> Any:
    """A byte-level BPE of at most `vocab_size` tokens trained on the lines of `text` (a
    `tokenizers.Tokenizer`; no cache: see `trained_bpe`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines(text), trainer)
    return tokenizer


def trained_bpe(text: str, vocab_size: int, cache: Path) -> tuple[Any, Path]:
    """The byte-level BPE of `vocab_size` for the training text `text`, and its cache file:
    read from `cache` when a trial trained it before (same text, size, recipe and
    `tokenizers` version), else trained once (other trials wait on the entry's lock) and
    written there. Both ways the tokenizer is the one read back from the file."""
    import tokenizers

    key = content_key(
        form="byte-level-bpe",
        recipe=BPE_VERSION,
        vocab_size=vocab_size,
        tokenizers=tokenizers.__version__,
        text=text_sha(text),
    )
    path = cache / f"bpe-{key[:32]}.json"
    if not path.is_file():
        with locked(path):
            if not path.is_file():
                tokenizer = train_bpe(text, vocab_size)
                write_atomic(path, lambda f: f.write(tokenizer.to_str()), binary=False)
    return tokenizers.Tokenizer.from_file(str(path)), path


def _encode_lines(tokenizer: Any, text: str, dtype: type[np.unsignedinteger[Any]]) -> np.ndarray:
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        parts.extend(np.asarray(e.ids, dtype=dtype) for e in encodings)
        batch.clear()

    for line in lines(text):
        batch.append(line)
        if len(batch) == ENCODE_LINES:
            flush()
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def encode_text(tokenizer: Any, n_ids: int, text: str, cache: Path) -> np.ndarray:
    """The ids of `text` under a `tokenizers.Tokenizer` that gives ids below `n_ids`
    (uint16 when they fit, else uint32), read memory-mapped from `cache` (encoded once per
    text and tokenizer)."""
    dtype = np.uint16 if n_ids <= 2**16 else np.uint32
    key = content_key(
        form="ids",
        text=text_sha(text),
        tokenizer=hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
        dtype=np.dtype(dtype).name,
    )
    path = cache / f"ids-{key[:32]}.npy"
    if not path.is_file():
        with locked(path):
            if not path.is_file():
                ids = _encode_lines(tokenizer, text, dtype)
                write_atomic(path, lambda f: np.save(f, ids), binary=True)
    try:
        out: np.ndarray = np.load(path, mmap_mode="r")
    except ValueError:  # numpy cannot map an empty array
        out = np.load(path)
    return out
