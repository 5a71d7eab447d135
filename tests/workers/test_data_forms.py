"""The data forms of docs/your-data.md (workers/data/), each against an independent
computation: the bytes tokenizer against Python's UTF-8 encoding, the BPE against decoding
(byte-level BPE is lossless) and the `tokenizers` library's own per-line encoding, `.bin`
files against numpy's view of the file, a dataset against the same text as a corpus
directory; the BPE cache by what it does (one training, the same tokenizer back), and each
problem by the field its error names."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

import workers.data.encode as encode
from tests.data_helpers import ROOT, WIKITEXT, bin_dir, data_forms, text_dir, wikitext
from workers.config import TaskConfig, TrialConfig
from workers.data.cache import CACHE_ENV, CACHE_SUBDIR, cache_dir
from workers.data.corpus import DataError
from workers.data.layout import POST_SCAN_TOKENS, check_data, dataset_split
from workers.tasks import LMTask, build_task, clear_corpus_cache

pytestmark = pytest.mark.skipif(not WIKITEXT.is_dir(), reason="WikiText-2 not available")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test's own data cache (never one inside the shared WikiText-2 copy), and no
    corpus left from another test."""
    path = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(path))
    clear_corpus_cache()
    yield path
    clear_corpus_cache()


@pytest.fixture
def trainings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the BPE trainings (the real `train_bpe` still runs)."""
    calls: list[int] = []
    real = encode.train_bpe

    def counted(text: str, vocab_size: int) -> Any:
        calls.append(vocab_size)
        return real(text, vocab_size)

    monkeypatch.setattr(encode, "train_bpe", counted)
    return calls


def lm(data_dir: Path, **over: Any) -> TaskConfig:
    return TaskConfig.model_validate(
        {"kind": "lm", "data_dir": str(data_dir), "seq_len": 32, **over}
    )


def wiki(**over: Any) -> TaskConfig:
    """The real WikiText-2, as DESIGN.md says: train on valid.txt, evaluate on test.txt."""
    return lm(WIKITEXT, train_split="valid", valid_split="test", **over)


def starts_of(n: int, seq_len: int, batch: int, seed: int) -> list[int]:
    """The window starts `LMTask.train_batch` draws from a generator of `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n - seq_len, (batch,), generator=g).tolist()


def check_windows(task: LMTask, ids: np.ndarray, seed: int = 3) -> None:
    """A training batch and the validation batches are windows of `ids` (the training split)
    and of the task's validation split, as int64."""
    x, y = task.train_batch(4, torch.Generator().manual_seed(seed))
    assert x.dtype == torch.int64 and x.shape == (4, task.seq_len)
    for b, s in enumerate(starts_of(len(ids), task.seq_len, 4, seed)):
        assert x[b].tolist() == ids[s : s + task.seq_len].astype(np.int64).tolist()
        assert y[b].tolist() == ids[s + 1 : s + task.seq_len + 1].astype(np.int64).tolist()
    vx, vy = task.valid_batches(2)[1]
    valid = np.asarray(task.valid_ids, dtype=np.int64)
    t = task.seq_len
    assert vx[0].tolist() == valid[2 * t : 3 * t].tolist()
    assert vy[1].tolist() == valid[3 * t + 1 : 4 * t + 1].tolist()


# ---- bytes ------------------------------------------------------------------------------------


def test_bytes_are_the_utf8_bytes_of_the_text() -> None:
    task = build_task(wiki(tokenizer="bytes"), 0)
    assert isinstance(task, LMTask) and task.vocab_size == 256
    train = np.frombuffer(wikitext("valid").encode("utf-8"), dtype=np.uint8)
    assert np.array_equal(task.train_ids, train)
    assert np.array_equal(task.valid_ids, np.frombuffer(wikitext("test").encode(), np.uint8))
    check_windows(task, train)


def test_bytes_of_non_ascii_text_and_a_larger_vocabulary(tmp_path: Path) -> None:
    text = "héllo wörld €\n" * 20
    d = text_dir(tmp_path / "c", train=text, valid=text)
    task = build_task(lm(d, tokenizer="bytes", vocab_size=300, seq_len=8), 0)
    assert task.vocab_size == 300  # the model's vocabulary: padded past the 256 byte values
    assert list(task.train_ids) == list(text.encode("utf-8"))
    assert list(task.train_ids[14:17]) == [0xE2, 0x82, 0xAC]  # the euro sign's three bytes


# ---- a byte-level BPE trained on the training split -------------------------------------------


def test_bpe_stream_decodes_to_the_text_and_is_the_tokenizers_own_encoding(
    trainings: list[int], cache: Path
) -> None:
    task = build_task(wiki(tokenizer="bpe", vocab_size=512), 0)
    assert isinstance(task, LMTask) and task.vocab_size == 512 and trainings == [512]
    tok = task.tokenizer
    assert tok.get_vocab_size() == 512
    valid, test = wikitext("valid"), wikitext("test")
    train_ids = np.asarray(task.train_ids)
    assert train_ids.max() < 512 and train_ids.dtype == np.uint16
    assert tok.decode(train_ids.tolist()) == valid  # lossless: the stream is the text
    assert tok.decode(np.asarray(task.valid_ids).tolist()) == test
    # the tokenizers library's own encoding, line by line, no special tokens
    by_line = [
        i
        for line in test.splitlines(keepends=True)
        for i in tok.encode(line, add_special_tokens=False).ids
    ]
    assert np.asarray(task.valid_ids).tolist() == by_line
    assert len(train_ids) < 0.5 * len(valid.encode())  # merges: fewer ids than bytes
    check_windows(task, train_ids)
    # a byte-level BPE: all 256 bytes in the base alphabet, the trained file in the cache
    assert json.loads(tok.to_str())["pre_tokenizer"]["type"] == "ByteLevel"
    assert len(list(cache.glob("bpe-*.json"))) == 1


def test_bpe_cache_hit_returns_the_identical_tokenizer_without_training(
    trainings: list[int], cache: Path, tmp_path: Path
) -> None:
    text = wikitext("valid", 1200)
    d = text_dir(tmp_path / "c", train=text, valid=wikitext("test", 300))
    first = build_task(lm(d, tokenizer="bpe", vocab_size=400), 0)
    [entry] = cache.glob("bpe-*.json")
    mtime = entry.stat().st_mtime_ns
    assert trainings == [400]
    clear_corpus_cache()  # a new process: only the disk cache is left
    second = build_task(lm(d, tokenizer="bpe", vocab_size=400), 1)
    assert trainings == [400]  # not trained again
    assert second.tokenizer.to_str() == first.tokenizer.to_str()
    assert np.array_equal(second.train_ids, first.train_ids)
    assert entry.stat().st_mtime_ns == mtime
    # another size, or another text, is another entry
    clear_corpus_cache()
    build_task(lm(d, tokenizer="bpe", vocab_size=300), 0)
    (d / "train.txt").write_text(text + "one more line\n", encoding="utf-8")
    build_task(lm(d, tokenizer="bpe", vocab_size=400), 0)
    assert trainings == [400, 300, 400]
    assert len(list(cache.glob("bpe-*.json"))) == 3


def test_bpe_training_is_deterministic_and_done_once_under_concurrent_trials(
    trainings: list[int], cache: Path
) -> None:
    """Two trials (threads here; processes hold the same file lock) ask at once: one trains,
    the other waits on the entry's lock and reads what it wrote."""
    text = wikitext("valid", 1200)
    barrier = threading.Barrier(2)
    got: list[str] = []

    def ask() -> None:
        barrier.wait()
        tok, _ = encode.trained_bpe(text, 350, cache)
        got.append(tok.to_str())

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert trainings == [350] and len(got) == 2 and got[0] == got[1]
    assert encode.train_bpe(text, 350).to_str() == got[0]  # the same recipe trains it again
    assert not list(cache.glob("*.tmp"))


def test_the_cache_is_in_the_data_dir_unless_it_cannot_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    d = text_dir(tmp_path / "c", train="a b\n")
    assert cache_dir(d) == d / CACHE_SUBDIR
    blocked = text_dir(tmp_path / "blocked", train="a b\n")
    (blocked / CACHE_SUBDIR).write_text("a file where the directory would be")
    assert cache_dir(blocked) == tmp_path / "home" / "qkscope"


# ---- the user's tokenizer.json ------------------------------------------------------------


def _tokenizer_with_bos(text: str, path: Path) -> Any:
    """A tokenizers JSON file whose post-processor adds <bos> (as Llama's does)."""
    from tokenizers import AddedToken
    from tokenizers.processors import TemplateProcessing

    tok = encode.train_bpe(text, 300)
    tok.add_special_tokens([AddedToken("<bos>", special=True)])
    bos = tok.token_to_id("<bos>")
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.save(str(path))
    return tok


def test_a_tokenizer_file_encodes_each_line_without_special_tokens(tmp_path: Path) -> None:
    train, valid = wikitext("valid", 1500), wikitext("test", 400)
    d = text_dir(tmp_path / "c", train=train, valid=valid)
    tok = _tokenizer_with_bos(train, d / "my-tok.json")
    bos = tok.token_to_id("<bos>")
    assert tok.encode("x").ids[0] == bos  # the file's own default adds it
    task = build_task(lm(d, tokenizer="file", tokenizer_file="my-tok.json", vocab_size=320), 0)
    assert task.vocab_size == 320
    want = [
        i
        for line in valid.splitlines(keepends=True)
        for i in tok.encode(line, add_special_tokens=False).ids
    ]
    assert np.asarray(task.valid_ids).tolist() == want
    assert bos not in set(np.asarray(task.train_ids).tolist())
    assert tok.decode(np.asarray(task.train_ids).tolist()) == train


def test_a_tokenizer_past_vocab_size_fails_naming_it(tmp_path: Path) -> None:
    d = text_dir(tmp_path / "c", train=wikitext("valid", 800), valid=wikitext("test", 200))
    _tokenizer_with_bos(wikitext("valid", 800), d / "tokenizer.json")  # ids 0..300
    with pytest.raises(DataError, match=r"task\.vocab_size: .*ids up to 300, past vocab_size 300"):
        build_task(lm(d, tokenizer="file", vocab_size=300), 0)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"task\.tokenizer_file: .*not a tokenizers JSON"):
        build_task(lm(d, tokenizer="file", vocab_size=400), 0)
    with pytest.raises(DataError, match=r"task\.tokenizer_file: .*nope\.json not found"):
        build_task(lm(d, tokenizer="file", tokenizer_file="nope.json", vocab_size=400), 0)


# ---- nanoGPT's .bin files -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_tokens_are_numpys_view_of_the_file(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    vocab = 50257 if dtype == "uint16" else 100_000
    d = bin_dir(
        tmp_path / "b",
        dtype,
        train=rng.integers(0, vocab, 5000),
        val=rng.integers(0, vocab, 700),
    )
    task = build_task(
        lm(d, format="bin", token_dtype=dtype, vocab_size=vocab, valid_split="val"), 0
    )
    assert isinstance(task, LMTask) and task.vocab_size == vocab
    train = np.fromfile(d / "train.bin", dtype=dtype)
    assert np.array_equal(task.train_ids, train) and task.train_ids.dtype == np.dtype(dtype)
    assert isinstance(task.train_ids, np.memmap)  # mapped, never read whole
    assert np.array_equal(task.valid_ids, np.fromfile(d / "val.bin", dtype=dtype))
    check_windows(task, train)
    short = build_task(
        lm(
            d,
            format="bin",
            token_dtype=dtype,
            vocab_size=vocab,
            valid_split="val",
            max_train_tokens=1000,
        ),
        0,
    )
    assert np.array_equal(short.train_ids, train[:1000])


def test_bin_of_real_wikitext_bytes_trains_a_trial(tmp_path: Path) -> None:
    """The .bin form end to end through `run_trial`: the ids of the real WikiText-2."""
    from workers.trial import run_trial

    ids = np.frombuffer(wikitext("valid").encode(), np.uint8)
    d = bin_dir(tmp_path / "b", train=ids[:200_000], val=ids[200_000:260_000])
    config = TrialConfig.model_validate(
        {
            "task": {
                "kind": "lm",
                "data_dir": str(d),
                "format": "bin",
                "vocab_size": 256,
                "valid_split": "val",
                "seq_len": 32,
            },  # fmt: skip
            "model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "d_ff": 64},
            "batch_size": 8,
            "steps": 30,
            "eval_every": 15,
            "eval_batches": 2,
            "device": "cpu",
        }  # fmt: skip
    )
    summary = run_trial(config)
    assert summary.status == "completed" and summary.steps_done == 30
    losses = [v for v in summary.val_losses if v is not None]
    assert losses[-1] < np.log(256)  # learnt something about English bytes


def test_bin_problems_name_their_field(tmp_path: Path) -> None:
    ids = np.arange(100, dtype=np.uint16)
    d = bin_dir(tmp_path / "b", train=ids, valid=ids)
    with pytest.raises(DataError, match=r"task\.vocab_size: .*token id 99 \(at token 99\)"):
        build_task(lm(d, format="bin", vocab_size=99), 0)
    build_task(lm(d, format="bin", vocab_size=100), 0)  # ids below it: fine
    (d / "valid.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 ids
    with pytest.raises(DataError, match=r"task\.token_dtype: .*3 bytes"):
        build_task(lm(d, format="bin", vocab_size=100), 0)
    (d / "valid.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"task\.valid_split: .*valid\.bin is empty"):
        build_task(lm(d, format="bin", vocab_size=100), 0)
    with pytest.raises(DataError, match=r"task\.valid_split: .*val\.bin not found"):
        build_task(lm(d, format="bin", vocab_size=100, valid_split="val"), 0)
    (d / "valid.bin").unlink()
    with pytest.raises(DataError, match="nanoGPT names it val.bin"):
        build_task(lm(d, format="bin", vocab_size=100), 0)
    bin_dir(d, valid=ids[:20])
    with pytest.raises(DataError, match=r"task\.valid_split: .*20 tokens, fewer than seq_len"):
        build_task(lm(d, format="bin", vocab_size=100), 0)


def test_the_post_scan_is_bounded_and_the_worker_scans_every_id(tmp_path: Path) -> None:
    """An id past the vocabulary beyond what the API reads passes the POST check; the worker
    finds it (and its trial fails with the reason)."""
    n = POST_SCAN_TOKENS + 10
    ids = np.zeros(n, dtype=np.uint16)
    ids[POST_SCAN_TOKENS + 3] = 7
    d = bin_dir(tmp_path / "b", train=ids, valid=np.zeros(100, np.uint16))
    task = lm(d, format="bin", vocab_size=5)
    assert check_data(task, d, "b") == []  # POST: the first POST_SCAN_TOKENS ids only
    problems = check_data(task, d, "b", scan_tokens=None)
    assert [p.field for p in problems] == ["vocab_size"]
    assert f"token id 7 (at token {POST_SCAN_TOKENS + 3})" in problems[0].message
    with pytest.raises(DataError, match="past the vocabulary"):
        build_task(task, 0)


# ---- a local dataset: JSONL, Parquet, save_to_disk ------------------------------------------


@pytest.fixture(scope="module")
def forms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The first lines of the real WikiText-2 splits as a corpus directory and as JSONL,
    Parquet (one file, and shards), and save_to_disk (a DatasetDict, and a Dataset per
    split), written by scripts/data_forms.py."""
    out = tmp_path_factory.mktemp("forms")
    texts = {"train": wikitext("valid", 2500), "valid": wikitext("test", 600)}
    dirs: dict[str, Path] = dict(data_forms().write_dataset_forms(texts, out, "w"))
    dirs["text"] = text_dir(out / "w-text", **texts)
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = out / "w-shards"
    shards.mkdir()
    for split, text in texts.items():
        rows = data_forms().rows_of(text)
        half = len(rows) // 2
        for i, part in enumerate((rows[:half], rows[half:])):
            pq.write_table(pa.table({"text": part}), shards / f"{split}-0000{i}-of-00002.parquet")
        datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(out / "w-split" / split))
    dirs["shards"], dirs["split"] = shards, out / "w-split"
    return dirs


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk", "shards", "split"])
@pytest.mark.parametrize("tokenizer", ["word", "bytes", "bpe"])
def test_a_dataset_gives_the_tokens_of_the_same_text_as_a_corpus_dir(
    forms: dict[str, Path], kind: str, tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(forms["text"].parent / "cache"))  # one BPE for all
    over: dict[str, Any] = {"tokenizer": tokenizer}
    if tokenizer == "bpe":
        over["vocab_size"] = 300
    if tokenizer == "word":
        over["vocab_cap"] = 2000
    text = build_task(lm(forms["text"], **over), 0)
    data = build_task(lm(forms[kind], format="dataset", **over), 0)
    assert data.vocab_size == text.vocab_size
    for a, b in ((data.train_ids, text.train_ids), (data.valid_ids, text.valid_ids)):
        assert np.asarray(a).tolist() == np.asarray(b).tolist()
    if tokenizer == "word":
        assert data.vocab == text.vocab


def test_dataset_layouts_are_found_and_problems_name_their_field(
    forms: dict[str, Path], tmp_path: Path
) -> None:
    assert dataset_split(forms["disk"], "train").kind == "disk"  # type: ignore[union-attr]
    assert dataset_split(forms["parquet"], "train").kind == "parquet"  # type: ignore[union-attr]
    assert dataset_split(forms["jsonl"], "valid").kind == "json"  # type: ignore[union-attr]
    assert len(dataset_split(forms["shards"], "train").paths) == 2  # type: ignore[union-attr]
    assert dataset_split(forms["disk"], "test") is None  # not listed in dataset_dict.json
    with pytest.raises(DataError, match=r"task\.valid_split: no dataset split 'test'"):
        build_task(lm(forms["parquet"], format="dataset", valid_split="test"), 0)
    for kind in ("jsonl", "parquet", "disk"):
        with pytest.raises(DataError, match=r"task\.text_column: .*no column 'body'"):
            build_task(lm(forms[kind], format="dataset", text_column="body"), 0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "odd"
    d.mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "train.parquet")
    pq.write_table(pa.table({"text": ["a b", None, "c"]}), d / "valid.parquet")
    with pytest.raises(DataError, match=r"task\.train_split: split 'train' of .* is empty"):
        build_task(lm(d, format="dataset"), 0)
    pq.write_table(
        pa.table({"text": ["a b c d e f g h"] * 10, "n": list(range(10))}), d / "train.parquet"
    )
    task = build_task(lm(d, format="dataset", tokenizer="bytes", seq_len=4), 0)
    assert bytes(np.asarray(task.valid_ids)) == b"a b\nc\n"  # the null row skipped
    with pytest.raises(DataError, match=r"task\.text_column: column 'n' holds"):
        build_task(lm(d, format="dataset", text_column="n", valid_split="train"), 0)
    # a JSON array (not JSON lines) under .json: not checkable cheaply, read by the worker
    arr = tmp_path / "array"
    arr.mkdir()
    (arr / "train.json").write_text(json.dumps([{"text": "a b c d e f g h i"}] * 5), "utf-8")
    (arr / "valid.json").write_text(json.dumps([{"text": "x y"}, {"text": "z"}]), "utf-8")
    assert check_data(lm(arr, format="dataset", tokenizer="bytes"), arr, "array") == []
    task = build_task(lm(arr, format="dataset", tokenizer="bytes", seq_len=4), 0)
    assert bytes(np.asarray(task.valid_ids)) == b"x y\nz\n"


# ---- the config, and what stays as it was ---------------------------------------------------


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"tokenizer": "bpe"}, "vocab_size"),
        ({"tokenizer": "file"}, "vocab_size"),
        ({"format": "bin"}, "vocab_size"),
        ({"format": "bin", "tokenizer": "bpe", "vocab_size": 300}, "tokenizer"),
        ({"tokenizer": "word", "vocab_size": 300}, "vocab_size"),
        ({"tokenizer": "char", "vocab_size": 300}, "vocab_size"),
        ({"tokenizer": "bytes", "vocab_size": 255}, "vocab_size"),
        ({"tokenizer": "bpe", "vocab_size": 100}, "vocab_size"),
        ({"format": "bin", "vocab_size": 70_000}, "token_dtype"),
        ({"tokenizer": "file", "vocab_size": 9, "tokenizer_file": "../t.json"}, "tokenizer_file"),
        ({"tokenizer": "file", "vocab_size": 9, "tokenizer_file": "/t.json"}, "tokenizer_file"),
        ({"tokenizer": "file", "vocab_size": 9, "tokenizer_file": "~/t.json"}, "tokenizer_file"),
        ({"format": "csv"}, "format"),
        ({"tokenizer": "sentencepiece"}, "tokenizer"),
        ({"text_column": ""}, "text_column"),
        ({"vocab_size": 1}, "vocab_size"),
    ],
)
def test_refused_settings_name_their_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        TrialConfig.model_validate({"task": {"kind": "lm", "data_dir": "d", **over}})
    assert info.value.errors()[0]["loc"][:2] == ("task", field), info.value.errors()


def test_an_old_config_dumps_and_trains_as_before(tmp_path: Path) -> None:
    """A definition written before these fields loads with text / word and no vocab_size,
    and its task is the word-level corpus of tests/workers/test_tasks.py (int64 tensors)."""
    task_cfg = TaskConfig.model_validate({"kind": "lm", "data_dir": str(WIKITEXT)})
    assert (task_cfg.format, task_cfg.tokenizer, task_cfg.vocab_size) == ("text", "word", None)
    assert task_cfg.fixed_vocab_size is None
    task = build_task(wiki(vocab_cap=500), 0)
    assert isinstance(task.train_ids, torch.Tensor) and task.train_ids.dtype == torch.int64
    assert task.vocab_size == 501 and task.tokenizer is None


def test_the_vocabulary_reaches_the_model_and_the_estimates(tmp_path: Path) -> None:
    from service.spec import vocab_size
    from workers.fusion_plan import vocab_bound
    from workers.member import build_model

    d = text_dir(tmp_path / "c", train=wikitext("valid", 300), valid=wikitext("test", 100))
    for over, want in (
        ({"tokenizer": "bytes"}, 256),
        ({"tokenizer": "bpe", "vocab_size": 333}, 333),
    ):
        config = TrialConfig.model_validate(
            {"task": {"kind": "lm", "data_dir": str(d), "seq_len": 16, **over}, "device": "cpu"}
        )
        task = build_task(config.task, 0)
        model = build_model(config, task)
        assert task.vocab_size == want == vocab_size(config) == vocab_bound(config)
        assert model.tok_emb.num_embeddings == want and model.head.out_features == want


def test_light_modules_import_no_tokenizers_datasets_or_torch() -> None:
    """The API checks the data with workers.data.layout: it imports none of them; the
    workers' task module imports torch but not tokenizers or datasets (lazily, per form)."""
    code = (
        "import sys, service.spec, workers.data.layout; "
        "print(sorted(m for m in ('torch', 'tokenizers', 'datasets') if m in sys.modules)); "
        "import workers.tasks; "
        "print(sorted(m for m in ('tokenizers', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
        check=True,
    )  # fmt: skip
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
