"""Where each data form keeps a split, and the cheap checks of a data directory that both the
API (at POST, under the data root: service/spec/checks.py) and the workers (before a trial
loads its data) run; torch-free, and `tokenizers` only for a tokenizer file.

Cheap means: a file's existence and size, a Parquet footer, the first line of a JSONL file,
a tokenizer's JSON, and at most `scan_tokens` ids of each `.bin` file (the API scans
`POST_SCAN_TOKENS`; a worker scans every id, in chunks). Tokenizing a corpus never happens
here. Each problem names the `TaskConfig` field to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.config_sections import TaskConfig

__all__ = [
    "MAX_TOKENIZER_BYTES",
    "POST_SCAN_TOKENS",
    "SCAN_CHUNK",
    "DataProblem",
    "DatasetSplit",
    "bin_path",
    "check_data",
    "dataset_split",
    "first_id_past",
    "needs_data_check",
    "text_path",
    "tokenizer_ids",
]

POST_SCAN_TOKENS = 1 << 22
"""Ids of each `.bin` file the API reads at POST (8 MiB of uint16): a token id past the
vocabulary further in is found by the worker, and fails that trial."""

SCAN_CHUNK = 1 << 24
"""Ids a full scan reads at a time (32 MiB of uint16)."""

MAX_TOKENIZER_BYTES = 256 * 2**20
"""A tokenizer file larger than this is not parsed at POST (the worker still checks it)."""


@dataclass(frozen=True)
class DataProblem:
    """What is wrong with a task's data: the TaskConfig field to change, and why."""

    field: str
    message: str


@dataclass(frozen=True)
class DatasetSplit:
    """Where a `format: dataset` split is: `kind` is `disk` (a `save_to_disk` Dataset
    directory), `parquet` or `json` (one or more files, in order)."""

    kind: str
    paths: tuple[Path, ...]


def needs_data_check(task: TaskConfig) -> bool:
    """Whether the POST checks this task's files: the forms of docs/your-data.md. Text with
    the word or char tokenizer keeps its old contract (only the path is checked at POST;
    the worker reports a missing file)."""
    return task.kind == "lm" and (task.format != "text" or task.tokenizer not in ("word", "char"))


def text_path(data_dir: Path, split: str) -> Path:
    return data_dir / f"{split}.txt"


def bin_path(data_dir: Path, split: str) -> Path:
    return data_dir / f"{split}.bin"


def dataset_split(data_dir: Path, split: str) -> DatasetSplit | None:
    """Where `split` of a `format: dataset` directory is, looked for in this order: a
    `save_to_disk` DatasetDict (`dataset_dict.json` listing it), a `save_to_disk` Dataset in
    `<split>/`, `<split>.parquet` or its shards `<split>-*.parquet`, `<split>.jsonl` (or
    `.json`) or its shards `<split>-*.jsonl`; None when none is there."""
    listing = data_dir / "dataset_dict.json"
    if listing.is_file():
        try:
            splits = json.loads(listing.read_text(encoding="utf-8")).get("splits", [])
        except (OSError, ValueError, AttributeError):
            splits = []
        if split in splits and (data_dir / split / "state.json").is_file():
            return DatasetSplit("disk", (data_dir / split,))
        return None
    if (data_dir / split / "state.json").is_file():
        return DatasetSplit("disk", (data_dir / split,))
    for kind, suffixes in (("parquet", (".parquet",)), ("json", (".jsonl", ".json"))):
        for suffix in suffixes:
            one = data_dir / f"{split}{suffix}"
            if one.is_file():
                return DatasetSplit(kind, (one,))
        shards = sorted(p for p in data_dir.glob(f"{split}-*{suffixes[0]}") if p.is_file())
        if shards:
            return DatasetSplit(kind, tuple(shards))
    return None


def first_id_past(
    path: Path, dtype: str, vocab_size: int, limit: int | None
) -> tuple[int, int] | None:
    """The first token id >= `vocab_size` in the `.bin` file at `path` and its position, among
    its first `limit` ids (all with None), read in chunks; None when there is none."""
    import numpy as np

    ids = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    n = len(ids) if limit is None else min(len(ids), limit)
    for start in range(0, n, SCAN_CHUNK):
        chunk = np.asarray(ids[start : min(n, start + SCAN_CHUNK)])
        if int(chunk.max()) >= vocab_size:
            at = int(np.argmax(chunk >= vocab_size))
            return int(chunk[at]), start + at
    return None


def _split_fields(task: TaskConfig) -> tuple[tuple[str, str], ...]:
    return (("train_split", task.train_split), ("valid_split", task.valid_split))


def check_data(
    task: TaskConfig,
    data_dir: Path,
    shown: str,
    scan_tokens: int | None = POST_SCAN_TOKENS,
) -> list[DataProblem]:
    """The problems of `task`'s data in `data_dir` (`shown` is how messages name that
    directory), for the forms `needs_data_check` covers; [] when it looks loadable."""
    if not needs_data_check(task):
        return []
    if not data_dir.is_dir():
        return [DataProblem("data_dir", f"{shown} is not a directory")]
    if task.format == "bin":
        return _check_bin(task, data_dir, shown, scan_tokens)
    problems: list[DataProblem] = []
    for field, split in _split_fields(task):
        if task.format == "text":
            problems += _check_text(field, text_path(data_dir, split), shown)
        else:
            problems += _check_dataset(task, field, split, data_dir, shown)
    if task.tokenizer == "file":
        problems += _check_tokenizer_file(task, data_dir, shown)
    return problems


def _check_text(field: str, path: Path, shown: str) -> list[DataProblem]:
    if not path.is_file():
        return [DataProblem(field, f"{shown}/{path.name} not found")]
    if path.stat().st_size == 0:
        return [DataProblem(field, f"{shown}/{path.name} is empty")]
    return []


def _check_bin(
    task: TaskConfig, data_dir: Path, shown: str, scan_tokens: int | None
) -> list[DataProblem]:
    import numpy as np

    assert task.vocab_size is not None  # TaskConfig requires it for bin
    size = np.dtype(task.token_dtype).itemsize
    problems: list[DataProblem] = []
    for field, split in _split_fields(task):
        path = bin_path(data_dir, split)
        name = f"{shown}/{path.name}"
        if not path.is_file():
            hint = " (nanoGPT names it val.bin: set valid_split: val)" if split == "valid" else ""
            problems.append(DataProblem(field, f"{name} not found{hint}"))
            continue
        n_bytes = path.stat().st_size
        if n_bytes == 0:
            problems.append(DataProblem(field, f"{name} is empty"))
            continue
        if n_bytes % size:
            problems.append(
                DataProblem(
                    "token_dtype",
                    f"{name} has {n_bytes} bytes, not a whole number of {task.token_dtype} "
                    f"ids ({size} bytes each): is token_dtype right?",
                )
            )
            continue
        if n_bytes // size < task.seq_len + 1:
            problems.append(
                DataProblem(
                    field,
                    f"{name} holds {n_bytes // size} tokens, fewer than seq_len + 1 = "
                    f"{task.seq_len + 1}",
                )
            )
            continue
        past = first_id_past(path, task.token_dtype, task.vocab_size, scan_tokens)
        if past is not None:
            problems.append(
                DataProblem(
                    "vocab_size",
                    f"{name} holds token id {past[0]} (at token {past[1]}), past the "
                    f"vocabulary: vocab_size is {task.vocab_size}, and every id must be below it",
                )
            )
    return problems


def _check_dataset(
    task: TaskConfig, field: str, split: str, data_dir: Path, shown: str
) -> list[DataProblem]:
    where = dataset_split(data_dir, split)
    if where is None:
        return [
            DataProblem(
                field,
                f"no dataset split {split!r} in {shown}: looked for a save_to_disk dataset "
                f"(dataset_dict.json listing it, or {split}/), {split}.parquet, "
                f"{split}-*.parquet, {split}.jsonl, {split}.json and {split}-*.jsonl",
            )
        ]
    try:
        columns, rows = _dataset_columns(where)
    except (OSError, ValueError) as e:
        return [DataProblem(field, f"{shown}: split {split!r} cannot be read: {e}")]
    if columns is not None and task.text_column not in columns:
        return [
            DataProblem(
                "text_column",
                f"split {split!r} of {shown} has no column {task.text_column!r} (it has "
                f"{', '.join(sorted(columns)) or 'none'})",
            )
        ]
    if rows == 0:
        return [DataProblem(field, f"split {split!r} of {shown} is empty")]
    return []


def _dataset_columns(where: DatasetSplit) -> tuple[set[str] | None, int | None]:
    """The columns of a dataset split and whether it has rows (0 when it has none; None
    when that is not known cheaply), from its metadata or first record only."""
    if where.kind == "parquet":
        import pyarrow.parquet as pq

        columns: set[str] = set()
        rows = 0
        for path in where.paths:
            meta = pq.read_metadata(path)
            columns |= set(meta.schema.names)
            rows += meta.num_rows
        return columns, rows
    if where.kind == "json":
        for path in where.paths:
            with path.open("rb") as f:
                for raw in f:
                    if raw.strip():
                        try:
                            record = json.loads(raw)
                        except ValueError:  # not JSON lines (a JSON array?): the worker reads it
                            return None, None
                        return (set(record), 1) if isinstance(record, dict) else (None, None)
        return None, 0
    info = where.paths[0] / "dataset_info.json"
    features = json.loads(info.read_text(encoding="utf-8")).get("features", {})
    return set(features), _disk_rows(where.paths[0])


def _disk_rows(directory: Path) -> int | None:
    """1 when a `save_to_disk` Dataset's first Arrow record batch has rows, 0 when none of
    its files has any, None when its files cannot be read cheaply."""
    import pyarrow as pa

    state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
    files = [directory / f["filename"] for f in state.get("_data_files", [])]
    try:
        for path in files:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_stream(source)
                for batch in reader:
                    if batch.num_rows:
                        return 1
    except (OSError, pa.ArrowInvalid):
        return None
    return 0


def _check_tokenizer_file(task: TaskConfig, data_dir: Path, shown: str) -> list[DataProblem]:
    path = data_dir / task.tokenizer_file
    name = f"{shown}/{task.tokenizer_file}"
    if not path.is_file():
        return [DataProblem("tokenizer_file", f"{name} not found")]
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        return []  # the worker checks it
    try:
        from tokenizers import Tokenizer

        n = tokenizer_ids(Tokenizer.from_file(str(path)))
    except Exception as e:  # the Rust side raises its own Exception type
        return [
            DataProblem("tokenizer_file", f"{name} is not a tokenizers JSON file: {str(e)[:300]}")
        ]
    assert task.vocab_size is not None  # TaskConfig requires it for file
    if n > task.vocab_size:
        return [
            DataProblem(
                "vocab_size",
                f"{name} gives ids up to {n - 1}, past vocab_size {task.vocab_size}: set "
                f"vocab_size to at least {n}",
            )
        ]
    return []


def tokenizer_ids(tokenizer: Any) -> int:
    """How many ids a `tokenizers.Tokenizer` may give: its largest id + 1 (added tokens
    included; they need not follow the model's vocabulary without a gap)."""
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    return max(vocab.values(), default=-1) + 1
