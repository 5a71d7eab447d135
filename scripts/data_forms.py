"""Write a text corpus in every data form qkscope reads (docs/your-data.md), for the
`study_defs/data_*.yaml` definitions and as a worked example of each form.

    python scripts/data_forms.py --source ../shared/data/wikitext-2 --out "$QKSCOPE_DATA_DIR"

From `<source>/<split>.txt` for each `--splits` (default: WikiText-2's `valid` and `test`; the
training split is not available offline here, so the definitions train on valid and evaluate
on test), it writes under `--out`:

- `<name>-tok/`: the text files and a `tokenizer.json` (a byte-level BPE of `--vocab-size`
  tokens trained on the first split, standing in for your own tokenizer): `tokenizer: file`.
- `<name>-bin/<split>.bin`: the text's ids under that tokenizer, uint16 (nanoGPT's form):
  `format: bin`, with `vocab_size` the tokenizer's size.
- `<name>-jsonl/<split>.jsonl`, `<name>-parquet/<split>.parquet` and `<name>-disk/` (a
  `datasets` DatasetDict written with `save_to_disk`): one row per line of the text, in the
  column `text`: `format: dataset`.

The `.bin` ids are what qkscope's `tokenizer: file` gives for the same text (each line encoded
alone, no special tokens), so every form here is one token stream. Needs `tokenizers`,
`datasets`, `pyarrow` and `numpy` (qkscope's dependencies); reads and writes local files only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["rows_of", "write_all", "write_bin", "write_dataset_forms", "write_tokenizer"]


def rows_of(text: str) -> list[str]:
    """The rows a dataset holds for `text`: its lines, without their newlines (qkscope joins a
    dataset's rows back as lines, so the rows give the same text when it ends with one)."""
    rows = text.split("\n")
    if text.endswith("\n"):
        rows.pop()
    return rows


def write_tokenizer(text: str, vocab_size: int, path: Path) -> Any:
    """Train qkscope's byte-level BPE on `text` and save it as a tokenizers JSON file."""
    from workers.data.encode import train_bpe

    tokenizer = train_bpe(text, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def write_bin(ids: np.ndarray, path: Path, dtype: str = "uint16") -> None:
    """Token ids as a flat array of `dtype` (nanoGPT's train.bin / val.bin)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    info = np.iinfo(np.dtype(dtype))
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > info.max):
        raise ValueError(f"ids outside {dtype}")
    np.asarray(ids, dtype=dtype).tofile(path)


def write_dataset_forms(texts: dict[str, str], out: Path, name: str) -> dict[str, Path]:
    """The splits' rows as JSONL, Parquet and a `save_to_disk` DatasetDict; their dirs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    dirs = {kind: out / f"{name}-{kind}" for kind in ("jsonl", "parquet", "disk")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, text in texts.items():
        rows = rows_of(text)
        with (dirs["jsonl"] / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"text": row}) + "\n")
        pq.write_table(pa.table({"text": rows}), dirs["parquet"] / f"{split}.parquet")
        splits[split] = datasets.Dataset.from_dict({"text": rows})
    datasets.DatasetDict(splits).save_to_disk(str(dirs["disk"]))
    return dirs


def write_all(
    source: Path, out: Path, splits: Sequence[str], vocab_size: int, name: str | None = None
) -> dict[str, Path]:
    """Every form of `source`'s splits under `out` (see the module's doc); their dirs."""
    from workers.data.encode import encode_text

    name = name or source.name
    texts = {s: (source / f"{s}.txt").read_text(encoding="utf-8") for s in splits}
    tok_dir = out / f"{name}-tok"
    tok_dir.mkdir(parents=True, exist_ok=True)
    for split in splits:
        shutil.copyfile(source / f"{split}.txt", tok_dir / f"{split}.txt")
    tokenizer = write_tokenizer(texts[splits[0]], vocab_size, tok_dir / "tokenizer.json")
    n_ids = tokenizer.get_vocab_size()
    with tempfile.TemporaryDirectory() as cache:
        for split in splits:
            ids = encode_text(tokenizer, n_ids, texts[split], Path(cache))
            write_bin(ids, out / f"{name}-bin" / f"{split}.bin")
    dirs = write_dataset_forms(texts, out, name)
    return {"tok": tok_dir, "bin": out / f"{name}-bin", **dirs}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="directory of <split>.txt")
    parser.add_argument("--out", type=Path, required=True, help="where to write the forms")
    parser.add_argument("--splits", nargs="+", default=["valid", "test"])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--name", default=None, help="prefix of the dirs (default: source's)")
    args = parser.parse_args(argv)
    dirs = write_all(args.source, args.out, args.splits, args.vocab_size, args.name)
    for kind, d in dirs.items():
        print(f"{kind:8s} {d}")


if __name__ == "__main__":
    main()
