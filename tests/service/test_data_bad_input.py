"""The bad-input table of the data forms (docs/your-data.md): each bad `task` setting or data
directory POSTed to an app whose data root (QKSCOPE_DATA_DIR) holds them gets a 422 naming
the field and the problem, tells nothing about files outside the root, and writes no row;
every good form is accepted. One app per database; no Ray (the studies stay PENDING)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.spec import FILE_RULE
from service.store.session import make_engine
from tests.data_helpers import WIKITEXT, bin_dir, text_dir, wikitext
from tests.service.helpers import VALID, check_rejected, n_studies, post
from workers.data.encode import train_bpe

pytestmark = pytest.mark.skipif(not WIKITEXT.is_dir(), reason="WikiText-2 not available")
JSON = "application/json"


def data_root(tmp_path: Path) -> Path:
    """A data root with good and bad directories of every form, and a secret outside it."""
    root = tmp_path / "data"
    train, valid = wikitext("valid", 400), wikitext("test", 100)
    wt = text_dir(root / "wt", train=train, valid=valid)
    train_bpe(train, 280).save(str(wt / "tokenizer.json"))  # ids 0..279
    text_dir(root / "empty", train=train, valid="")
    text_dir(root / "notok", train=train, valid=valid)
    (root / "notok" / "tokenizer.json").write_text("{not json")
    ids = np.frombuffer(train.encode(), np.uint8)[:2000]
    bin_dir(root / "bin", train=ids, valid=ids)
    bin_dir(root / "bin-val", train=ids, val=ids)
    bad = ids.astype(np.uint16).copy()
    bad[10] = 999
    bin_dir(root / "bin-bad", train=bad, valid=ids)
    bin_dir(root / "bin-short", train=ids[:10], valid=ids)
    bin_dir(root / "bin-odd", train=ids, valid=ids)
    (root / "bin-odd" / "train.bin").write_bytes(b"\x01\x02\x03")
    for name, rows in (("ds", train.split("\n")), ("ds-empty", [])):
        (root / name).mkdir()
        pq.write_table(
            pa.table({"text": pa.array(rows, pa.string())}), root / name / "train.parquet"
        )
        pq.write_table(pa.table({"text": valid.split("\n")}), root / name / "valid.parquet")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "train.txt").write_text("outside the root")
    link = text_dir(root / "link", valid=valid)
    (link / "train.txt").symlink_to(secret / "train.txt")
    (secret / "dataset_dict.json").write_text('{"splits": ["train", "valid"]}')
    (root / "ds-link").mkdir()
    (root / "ds-link" / "dataset_dict.json").symlink_to(secret / "dataset_dict.json")
    return root


def study(task: dict[str, Any], space: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    body = {**VALID, "base": {"task": {"kind": "lm", "seq_len": 16, **task}, **top}}
    if space is not None:
        body["search_space"] = space
    return body


def cat(*choices: Any) -> dict[str, Any]:
    return {"type": "categorical", "choices": list(choices)}


# (label, body, the field named; a list where each of several is)
CASES: list[tuple[str, dict[str, Any], str | list[str]]] = [
    # the fields themselves
    ("bpe without vocab_size", study({"data_dir": "wt", "tokenizer": "bpe"}), "base.task.vocab_size"),
    ("file without vocab_size", study({"data_dir": "wt", "tokenizer": "file"}), "base.task.vocab_size"),
    ("bin without vocab_size", study({"data_dir": "bin", "format": "bin"}), "base.task.vocab_size"),
    ("bin with a tokenizer", study({"data_dir": "bin", "format": "bin", "tokenizer": "bpe", "vocab_size": 300}), "base.task.tokenizer"),
    ("word with vocab_size", study({"data_dir": "wt", "vocab_size": 300}), "base.task.vocab_size"),
    ("bytes below 256", study({"data_dir": "wt", "tokenizer": "bytes", "vocab_size": 100}), "base.task.vocab_size"),
    ("bpe below 256", study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": 200}), "base.task.vocab_size"),
    ("uint16 past 65536", study({"data_dir": "bin", "format": "bin", "vocab_size": 70_000}), "base.task.token_dtype"),
    ("tokenizer_file up", study({"data_dir": "wt", "tokenizer": "file", "vocab_size": 300, "tokenizer_file": "../x.json"}), "base.task.tokenizer_file"),
    ("tokenizer_file absolute", study({"data_dir": "wt", "tokenizer": "file", "vocab_size": 300, "tokenizer_file": "/etc/passwd"}), "base.task.tokenizer_file"),
    ("unknown format", study({"data_dir": "wt", "format": "csv"}), "base.task.format"),
    ("unknown tokenizer", study({"data_dir": "wt", "tokenizer": "sentencepiece"}), "base.task.tokenizer"),
    ("unknown dtype", study({"data_dir": "bin", "format": "bin", "vocab_size": 256, "token_dtype": "int8"}), "base.task.token_dtype"),
    ("vocab_size a string", study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": "big"}), "base.task.vocab_size"),
    ("vocab_size past the config's bound", study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": 10**9}), "base.task.vocab_size"),
    # the files under the data root
    ("no such directory", study({"data_dir": "nope", "tokenizer": "bytes"}), "base.task.data_dir"),
    ("no train split", study({"data_dir": "wt", "tokenizer": "bytes", "train_split": "nope"}), "base.task.train_split"),
    ("empty valid split", study({"data_dir": "empty", "tokenizer": "bpe", "vocab_size": 300}), "base.task.valid_split"),
    ("no valid.bin (nanoGPT's val.bin)", study({"data_dir": "bin-val", "format": "bin", "vocab_size": 256}), "base.task.valid_split"),
    ("bin of odd bytes", study({"data_dir": "bin-odd", "format": "bin", "vocab_size": 256}), "base.task.token_dtype"),
    ("bin id past the vocabulary", study({"data_dir": "bin-bad", "format": "bin", "vocab_size": 256}), "base.task.vocab_size"),
    ("bin shorter than seq_len", study({"data_dir": "bin-short", "format": "bin", "vocab_size": 256}), "base.task.train_split"),
    ("no tokenizer file", study({"data_dir": "wt", "tokenizer": "file", "vocab_size": 300, "tokenizer_file": "none.json"}), "base.task.tokenizer_file"),
    ("tokenizer file not JSON", study({"data_dir": "notok", "tokenizer": "file", "vocab_size": 300}), "base.task.tokenizer_file"),
    ("tokenizer past vocab_size", study({"data_dir": "wt", "tokenizer": "file", "vocab_size": 260}), "base.task.vocab_size"),
    ("no dataset split", study({"data_dir": "wt", "format": "dataset"}), "base.task.train_split"),
    ("no text column", study({"data_dir": "ds", "format": "dataset", "text_column": "body"}), "base.task.text_column"),
    ("empty dataset split", study({"data_dir": "ds-empty", "format": "dataset"}), "base.task.train_split"),
    # searched values
    ("searched vocab_size too small", study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": 300}, {"task.vocab_size": cat(300, 10)}), "search_space.task.vocab_size"),
    ("searched tokenizer without vocab_size", study({"data_dir": "wt"}, {"task.tokenizer": cat("word", "bpe")}), "search_space.task.tokenizer"),
    ("searched data_dir with a bad id", study({"data_dir": "bin", "format": "bin", "vocab_size": 256}, {"task.data_dir": cat("bin", "bin-bad")}), "search_space.task.data_dir"),
    ("searched format without the files", study({"data_dir": "wt", "tokenizer": "bytes"}, {"task.format": cat("text", "dataset")}), "search_space.task.format"),
    ("searched forms not all found", study({"data_dir": "wt", "tokenizer": "bytes"}, {"task.data_dir": cat("wt", "ds"), "task.format": cat("text", "dataset")}), ["search_space.task.data_dir", "search_space.task.format"]),
]  # fmt: skip

GOOD: list[tuple[str, dict[str, Any]]] = [
    ("text bytes", study({"data_dir": "wt", "tokenizer": "bytes"})),
    ("text bpe", study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": 300})),
    ("text file", study({"data_dir": "wt", "tokenizer": "file", "vocab_size": 280})),
    ("bin", study({"data_dir": "bin", "format": "bin", "vocab_size": 256})),
    ("bin val", study({"data_dir": "bin-val", "format": "bin", "vocab_size": 256, "valid_split": "val"})),
    ("dataset word", study({"data_dir": "ds", "format": "dataset"})),
    ("dataset bpe", study({"data_dir": "ds", "format": "dataset", "tokenizer": "bpe", "vocab_size": 300})),
    ("searched vocab_size", study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": 300}, {"task.vocab_size": cat(300, 512)})),
    ("searched data_dir", study({"data_dir": "wt", "tokenizer": "bytes"}, {"task.data_dir": cat("wt", "notok")})),
    ("word on a missing dir (checked by the worker, as before)", study({"data_dir": "not-there-yet"})),
]  # fmt: skip


def test_bad_data_settings_are_422s_naming_the_field_and_nothing_is_written(
    db_url: str, tmp_path: Path
) -> None:
    root = data_root(tmp_path)
    settings = Settings(
        database_url=db_url, ray_address="", api_tokens="", home=tmp_path, data_dir=str(root)
    )
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        engine = make_engine(db_url)
        try:
            for label, body, field in CASES:
                out = check_rejected(c, body, JSON, label)
                assert out["status"] == 422, (label, out)
                fields = [e["field"] for e in out["errors"]]
                assert fields == (field if isinstance(field, list) else [field]), (label, out)
                assert str(tmp_path) not in out["message"], (label, out)  # root-relative names
            assert n_studies(engine) == 0
            # a symlink out of the root: the rule, whatever is outside
            out = check_rejected(c, study({"data_dir": "link", "tokenizer": "bytes"}), JSON)
            assert [e["field"] for e in out["errors"]] == ["base.task.train_split"], out
            assert out["errors"][0]["message"] == FILE_RULE, out
            out = check_rejected(c, study({"data_dir": "ds-link", "format": "dataset"}), JSON)
            assert [e["field"] for e in out["errors"]] == ["base.task.data_dir"], out
            assert out["errors"][0]["message"] == FILE_RULE, out
            # a vocabulary the deployment's limits refuse (the memory of the logits)
            big = study({"data_dir": "wt", "tokenizer": "bpe", "vocab_size": 4_000_000})
            out = check_rejected(c, big, JSON)
            assert out["error"] == "limit_exceeded", out
            assert "base.task.vocab_size" in [e["field"] for e in out["errors"]], out
            assert n_studies(engine) == 0
            for i, (label, body) in enumerate(GOOD):
                r = post(c, {**body, "name": f"good-{i}"}, JSON)
                assert r.status_code == 201, (label, r.text)
            assert n_studies(engine) == len(GOOD)
        finally:
            engine.dispose()


def test_without_a_data_root_the_api_checks_no_files(db_url: str, tmp_path: Path) -> None:
    """Unset QKSCOPE_DATA_DIR: relative paths are read from the workers' working directory,
    which the API does not see; the fields are checked, the files are the workers' to check."""
    settings = Settings(database_url=db_url, ray_address="", api_tokens="", home=tmp_path)
    with TestClient(create_app(settings, reconcile_loop=False), raise_server_exceptions=False) as c:
        r = post(c, study({"data_dir": "nope", "format": "bin", "vocab_size": 256}), JSON)
        assert r.status_code == 201, r.text
        out = check_rejected(c, study({"data_dir": "nope", "format": "bin"}), JSON)
        assert [e["field"] for e in out["errors"]] == ["base.task.vocab_size"], out
