"""The token ids of a language-modelling task's two splits, for the data forms of
docs/your-data.md (the word and char tokenizers on text stay in workers/tasks_lm.py);
torch-free.

- `format: text`: `<split>.txt`, tokenized by bytes, bpe or file (workers/data/encode.py).
- `format: bin`: `<split>.bin`, ids of `token_dtype`, memory-mapped (never read whole); every
  id is checked to be below `vocab_size` once per process, in chunks.
- `format: dataset`: a local Parquet, JSONL or `save_to_disk` dataset read with Hugging Face
  `datasets` offline (`HF_DATASETS_OFFLINE=1`), its `text_column` joined into one text, each
  row a line (a newline after each row's text unless it ends with one; null rows skipped),
  then tokenized as text is. A dataset split and the text file of its rows' lines give the
  same ids.

Anything wrong with the data raises `DataError` naming the TaskConfig field to change: the
trial fails with that reason, its study goes on. Loaded corpora are kept per process, keyed
by the settings and each source file's size and modification time.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.config_sections import TaskConfig
from workers.data.cache import cache_dir
from workers.data.encode import bytes_ids, encode_text, trained_bpe
from workers.data.layout import (
    DatasetSplit,
    bin_path,
    check_data,
    dataset_split,
    text_path,
    tokenizer_ids,
)

__all__ = [
    "DataError",
    "TokenCorpus",
    "clear_token_cache",
    "dataset_text",
    "load_split",
    "load_token_corpus",
    "source_stats",
    "split_texts",
]


class DataError(ValueError):
    """The task's data cannot be used; the message starts with the `task.<field>` to change."""


@dataclass(frozen=True)
class TokenCorpus:
    """Both splits as 1-D arrays of unsigned ids below `vocab_size` (memory-mapped where
    they come from a file), and the tokenizer that made them (bpe and file; else None)."""

    vocab_size: int
    train_ids: np.ndarray
    valid_ids: np.ndarray
    tokenizer: Any = None
    tokenizer_path: Path | None = None


_CACHE: dict[tuple[Any, ...], TokenCorpus] = {}
_LOCK = threading.Lock()


def clear_token_cache() -> None:
    """Forget every corpus this process loaded (the next task reads its files again)."""
    with _LOCK:
        _CACHE.clear()


def _sources(task: TaskConfig, data_dir: Path) -> list[Path]:
    """The files a corpus is read from (their stats key the in-process cache)."""
    splits = (task.train_split, task.valid_split)
    if task.format == "bin":
        return [bin_path(data_dir, s) for s in splits]
    out: list[Path] = []
    for split in splits:
        if task.format == "text":
            out.append(text_path(data_dir, split))
            continue
        where = dataset_split(data_dir, split)
        for p in where.paths if where is not None else ():
            out += sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    if task.tokenizer == "file":
        out.append(data_dir / task.tokenizer_file)
    return out


def _stat(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError:
        return (str(path), -1, -1)
    return (str(path), st.st_mtime_ns, st.st_size)


def source_stats(task: TaskConfig, data_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """(path, modification time, size) of each file the task's data is read from."""
    return tuple(_stat(p) for p in _sources(task, data_dir))


def split_texts(task: TaskConfig, data_dir: Path) -> tuple[str, str]:
    """The training and validation text of a `format: text` or `dataset` task (checked first:
    a problem raises `DataError` naming the field)."""
    problems = check_data(task, data_dir, str(data_dir), scan_tokens=None)
    if problems:
        raise DataError("; ".join(f"task.{p.field}: {p.message}" for p in problems))
    return (
        _read_text(task, data_dir, "train_split", task.train_split),
        _read_text(task, data_dir, "valid_split", task.valid_split),
    )


def load_token_corpus(task: TaskConfig) -> TokenCorpus:
    """The corpus of an lm task of a docs/your-data.md form, loaded once per process."""
    assert task.data_dir is not None  # TaskConfig requires it for lm
    data_dir = Path(task.data_dir).expanduser().resolve()
    key = (
        str(data_dir),
        task.model_dump_json(exclude={"seq_len", "n_symbols", "n_pairs", "n_valid"}),
        source_stats(task, data_dir),
    )
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is None:
            cached = _CACHE[key] = _load(task, data_dir)
    _check_length(task, cached)
    return cached


def _fail(field: str, message: str) -> DataError:
    return DataError(f"task.{field}: {message}")


def _load(task: TaskConfig, data_dir: Path) -> TokenCorpus:
    if task.format == "bin":
        problems = check_data(task, data_dir, str(data_dir), scan_tokens=None)
        if problems:
            raise DataError("; ".join(f"task.{p.field}: {p.message}" for p in problems))
        dtype = np.dtype(task.token_dtype)
        assert task.vocab_size is not None
        mapped: list[np.ndarray] = [
            np.memmap(bin_path(data_dir, s), dtype=dtype, mode="r")
            for s in (task.train_split, task.valid_split)
        ]
        return TokenCorpus(task.vocab_size, _truncate(task, mapped[0]), mapped[1])
    train_text, valid_text = split_texts(task, data_dir)
    vocab = task.fixed_vocab_size
    assert vocab is not None  # bytes, bpe and file all fix it
    if task.tokenizer == "bytes":
        return TokenCorpus(vocab, _truncate(task, bytes_ids(train_text)), bytes_ids(valid_text))
    cache = cache_dir(data_dir)
    if task.tokenizer == "bpe":
        tokenizer, path = trained_bpe(train_text, vocab, cache)
    else:
        tokenizer, path = _tokenizer_file(task, data_dir)
    n_ids = tokenizer_ids(tokenizer)
    if n_ids > vocab:  # a file checked above, or a BPE that outgrew its size: never
        raise _fail("vocab_size", f"the tokenizer gives ids up to {n_ids - 1}, past {vocab}")
    train_ids = encode_text(tokenizer, n_ids, train_text, cache)
    valid_ids = encode_text(tokenizer, n_ids, valid_text, cache)
    return TokenCorpus(vocab, _truncate(task, train_ids), valid_ids, tokenizer, path)


def _truncate(task: TaskConfig, ids: np.ndarray) -> np.ndarray:
    return ids if task.max_train_tokens is None else ids[: task.max_train_tokens]


def _check_length(task: TaskConfig, corpus: TokenCorpus) -> None:
    for field, ids in (("train_split", corpus.train_ids), ("valid_split", corpus.valid_ids)):
        if len(ids) < task.seq_len + 1:
            split = getattr(task, field)
            raise _fail(
                field,
                f"split {split!r} has {len(ids)} tokens, fewer than seq_len + 1 = "
                f"{task.seq_len + 1}",
            )


def _tokenizer_file(task: TaskConfig, data_dir: Path) -> tuple[Any, Path]:
    from tokenizers import Tokenizer

    path = data_dir / task.tokenizer_file
    try:
        return Tokenizer.from_file(str(path)), path
    except Exception as e:  # the Rust side raises its own Exception type
        raise _fail("tokenizer_file", f"{path} cannot be loaded: {str(e)[:300]}") from None


def _read_text(task: TaskConfig, data_dir: Path, field: str, split: str) -> str:
    if task.format == "text":
        return text_path(data_dir, split).read_text(encoding="utf-8")
    where = dataset_split(data_dir, split)
    if where is None:  # check_data found it a moment ago
        raise _fail(field, f"no dataset split {split!r} in {data_dir}")
    return dataset_text(where, task.text_column, cache_dir(data_dir) / "datasets")


def _datasets() -> Any:
    """`datasets`, imported offline (it reads these variables at import)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    return datasets


def load_split(where: DatasetSplit, cache: Path) -> Any:
    """The `datasets.Dataset` of one split, read from local files only."""
    datasets = _datasets()
    if where.kind == "disk":
        return datasets.load_from_disk(str(where.paths[0]))
    return datasets.load_dataset(
        where.kind,
        data_files=[str(p) for p in where.paths],
        split="train",  # the name `datasets` gives the files of data_files
        cache_dir=str(cache),
    )


def dataset_text(where: DatasetSplit, column: str, cache: Path) -> str:
    """The text of a dataset split: its rows' `column` values as lines, in order."""
    ds = load_split(where, cache)
    if column not in ds.column_names:
        raise _fail("text_column", f"no column {column!r} (it has {', '.join(ds.column_names)})")
    feature = ds.features[column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise _fail("text_column", f"column {column!r} holds {feature}, not text")
    parts: list[str] = []
    for batch in ds.select_columns([column]).iter(batch_size=10_000):
        for value in batch[column]:
            if value is None:
                continue
            parts.append(value if value.endswith("\n") else value + "\n")
    return "".join(parts)
