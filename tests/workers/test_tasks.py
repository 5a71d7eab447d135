"""Tests for workers.tasks: batch layout, targets, vocabularies and reproducibility.

Everything is checked against an independent recomputation (from the raw text for language
modelling, by parsing the example for the synthetic tasks), never against the implementation.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pydantic
import pytest
import torch
from torch import Tensor

from workers.tasks import (
    IGNORE_INDEX,
    MAX_VALID_BATCHES,
    AssociativeRecallTask,
    CopyTask,
    LMTask,
    SortTask,
    TaskConfig,
    build_task,
    clear_corpus_cache,
)

WIKITEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _write(directory: Path, **splits: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for stem, text in splits.items():
        (directory / f"{stem}.txt").write_text(text, encoding="utf-8")
    return directory


def _reference_words(path: Path) -> list[str]:
    """Word tokens the way the PyTorch word_language_model example builds them."""
    out: list[str] = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            out.extend(line.split() + ["<eos>"])
    return out


def _check_batch(x: Tensor, y: Tensor, batch_size: int, seq_len: int, vocab_size: int) -> None:
    assert x.shape == (batch_size, seq_len)
    assert y.shape == (batch_size, seq_len)
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.device.type == "cpu" and y.device.type == "cpu"
    assert int(x.min()) >= 0 and int(x.max()) < vocab_size
    taken = y[y != IGNORE_INDEX]
    assert taken.numel() > 0
    assert int(taken.min()) >= 0 and int(taken.max()) < vocab_size


def _same(a: list[tuple[Tensor, Tensor]], b: list[tuple[Tensor, Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True)
    )


# --------------------------------------------------------------------------------------------
# Config validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "lm"}, "data_dir"),
        ({"kind": "associative_recall", "seq_len": 16, "n_pairs": 8}, "seq_len"),
        ({"kind": "associative_recall", "n_symbols": 4, "n_pairs": 5}, "n_pairs"),
        ({"kind": "sort", "seq_len": 2}, "seq_len"),
        ({"kind": "copy", "n_symbols": 1}, "n_symbols"),
        ({"kind": "lm", "data_dir": "/x", "vocab_cap": 3}, "vocab_cap"),
        ({"kind": "lm", "data_dir": "/x", "max_train_tokens": 10}, "max_train_tokens"),
        ({"kind": "lm", "data_dir": "/x", "train_split": "../train"}, "train_split"),
        ({"kind": "bogus"}, "kind"),
        ({"n_valid": 4}, "n_valid"),
        ({"batch_size": 4}, "batch_size"),  # extra="forbid"
    ],
)
def test_invalid_config_names_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        TaskConfig.model_validate(kwargs)
    assert field in str(info.value)


def test_valid_configs_accepted() -> None:
    assert TaskConfig().kind == "associative_recall"
    TaskConfig(kind="associative_recall", seq_len=18, n_pairs=8)  # exactly 2p + 2
    TaskConfig(kind="sort", seq_len=4)
    TaskConfig(kind="lm", data_dir="/anywhere")  # files are only read by build_task


# --------------------------------------------------------------------------------------------
# Language modelling on tiny corpora
# --------------------------------------------------------------------------------------------


def test_lm_word_vocab_order_and_targets_from_raw_text(tmp_path: Path) -> None:
    train = "the cat sat\non the mat\nthe end"  # last line has no trailing newline
    data = _write(tmp_path / "d", train=train, valid="the dog sat down\n")
    cfg = TaskConfig(kind="lm", data_dir=str(data), seq_len=4, tokenizer="word")
    task = build_task(cfg, seed=0)
    assert isinstance(task, LMTask)
    assert task.known_optimum is None

    words = _reference_words(data / "train.txt")
    counts = Counter(words)
    expected_vocab = ["<unk>"] + sorted(counts, key=lambda w: (-counts[w], w))
    assert list(task.vocab) == expected_vocab
    assert task.vocab[:3] == ("<unk>", "<eos>", "the")  # both x3; tie broken by string
    assert task.vocab_size == len(expected_vocab)

    # Every training row is a window of the raw token stream, and y is x shifted by one.
    g = _gen(1)
    starts_seen: set[int] = set()
    for _ in range(20):
        x, y = task.train_batch(8, g)
        _check_batch(x, y, 8, 4, task.vocab_size)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
            xs = [task.vocab[i] for i in xr]
            ys = [task.vocab[i] for i in yr]
            matches = [
                o
                for o in range(len(words) - 4)
                if words[o : o + 4] == xs and words[o + 1 : o + 5] == ys
            ]
            assert matches, (xs, ys)
            starts_seen.update(matches)
    # All len(words) - seq_len start offsets are reachable (incl. the very last window).
    assert starts_seen == set(range(len(words) - 4))

    # Validation: "dog" is not in the training split -> <unk>; windows are consecutive.
    assert "dog" not in task.vocab
    (vx, vy), *rest = task.valid_batches(8)
    assert rest == []
    assert vx.shape == (1, 4)
    vocab = {w: i for i, w in enumerate(task.vocab)}
    valid_ids = [vocab.get(w, 0) for w in _reference_words(data / "valid.txt")]
    assert vx[0].tolist() == valid_ids[0:4]
    assert vy[0].tolist() == valid_ids[1:5]
    assert vx[0, 1].item() == 0  # dog -> <unk>


def test_lm_vocab_cap_and_unk(tmp_path: Path) -> None:
    # word_i appears i times, for i = 1..30: the 16 kept are the most frequent.
    lines = [" ".join([f"w{i:02d}"] * i) for i in range(1, 31)]
    text = "\n".join(lines) + "\n"
    data = _write(tmp_path / "d", train=text, valid=text)
    cfg = TaskConfig(kind="lm", data_dir=str(data), seq_len=8, vocab_cap=16)
    task = build_task(cfg, seed=0)
    assert isinstance(task, LMTask)
    assert task.vocab_size == 17
    # <eos> appears 30 times, more than any word; then w30 .. w16.
    assert list(task.vocab) == ["<unk>", "<eos>"] + [f"w{i:02d}" for i in range(30, 15, -1)]

    rare = sum(range(1, 16))  # occurrences of w01..w15
    assert int((task.train_ids == 0).sum()) == rare
    seen = torch.cat([x.flatten() for x, _ in task.valid_batches(4)])
    assert int(seen.max()) < 17
    assert int((seen == 0).sum()) > 0


def test_lm_literal_unk_in_text_maps_to_id_zero(tmp_path: Path) -> None:
    text = "<unk> a <unk> b <unk>\n" * 10
    data = _write(tmp_path / "d", train=text, valid=text)
    task = build_task(TaskConfig(kind="lm", data_dir=str(data), seq_len=4), seed=0)
    assert isinstance(task, LMTask)
    assert task.vocab.count("<unk>") == 1 and task.vocab[0] == "<unk>"
    assert task.train_ids[:6].tolist() == [0, task.vocab.index("a"), 0, task.vocab.index("b"), 0, 1]


def test_lm_vocab_from_train_split_only(tmp_path: Path) -> None:
    data = _write(
        tmp_path / "d",
        train="alpha beta alpha\n" * 5,
        valid="gamma gamma gamma delta alpha\n" * 5,
    )
    task = build_task(TaskConfig(kind="lm", data_dir=str(data), seq_len=4), seed=0)
    assert isinstance(task, LMTask)
    assert set(task.vocab) == {"<unk>", "<eos>", "alpha", "beta"}
    assert task.valid_ids[:5].tolist() == [0, 0, 0, 0, task.vocab.index("alpha")]


def test_lm_char_tokenizer(tmp_path: Path) -> None:
    data = _write(tmp_path / "d", train="abcab\nba", valid="abzab\n")
    task = build_task(
        TaskConfig(kind="lm", data_dir=str(data), seq_len=4, tokenizer="char"), seed=0
    )
    assert isinstance(task, LMTask)
    # a x3, b x3, c x1, \n x1 -> ties by string: "\n" < "c", "a" < "b"
    assert list(task.vocab) == ["<unk>", "a", "b", "\n", "c"]
    stoi = {c: i for i, c in enumerate(task.vocab)}
    assert task.train_ids.tolist() == [stoi[c] for c in "abcab\nba"]
    assert task.valid_ids.tolist() == [stoi["a"], stoi["b"], 0, stoi["a"], stoi["b"], stoi["\n"]]
    x, y = task.train_batch(3, _gen(0))
    _check_batch(x, y, 3, 4, task.vocab_size)


def test_lm_missing_files_name_the_file(tmp_path: Path) -> None:
    data = _write(tmp_path / "d", train="a b c d e f g\n")
    with pytest.raises(FileNotFoundError, match="valid.txt"):
        build_task(TaskConfig(kind="lm", data_dir=str(data)), seed=0)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        build_task(TaskConfig(kind="lm", data_dir=str(data), train_split="nope"), seed=0)
    with pytest.raises(FileNotFoundError, match="train.txt"):
        build_task(TaskConfig(kind="lm", data_dir=str(tmp_path / "missing")), seed=0)


def test_lm_corpus_too_short_for_seq_len(tmp_path: Path) -> None:
    data = _write(tmp_path / "d", train="a b\n", valid="a b c d e f g h\n")
    with pytest.raises(ValueError, match="seq_len"):
        build_task(TaskConfig(kind="lm", data_dir=str(data), seq_len=8), seed=0)


def test_lm_cache_reuses_corpus_and_sees_edits(tmp_path: Path) -> None:
    clear_corpus_cache()
    data = _write(tmp_path / "d", train="a b c d e f\n" * 4, valid="a b c d e\n")
    cfg = TaskConfig(kind="lm", data_dir=str(data), seq_len=4)
    t1 = build_task(cfg, seed=0)
    t2 = build_task(cfg, seed=1)
    assert isinstance(t1, LMTask) and isinstance(t2, LMTask)
    assert t1.train_ids is t2.train_ids  # no re-tokenization
    _write(data, train="x y z w v u t s\n" * 4)
    t3 = build_task(cfg, seed=0)
    assert isinstance(t3, LMTask)
    assert "x" in t3.vocab and "a" not in t3.vocab
    clear_corpus_cache()


def test_bad_batch_args() -> None:
    task = build_task(TaskConfig(kind="copy", seq_len=9), seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        task.train_batch(0, _gen(0))
    with pytest.raises(ValueError, match="batch_size"):
        task.valid_batches(0)


# --------------------------------------------------------------------------------------------
# Language modelling on WikiText-2 (validation split trains, test split validates)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wikitext_task() -> LMTask:
    if not (WIKITEXT / "valid.txt").is_file() or not (WIKITEXT / "test.txt").is_file():
        pytest.skip(f"WikiText-2 valid.txt/test.txt not found under {WIKITEXT}")
    cfg = TaskConfig(
        kind="lm",
        data_dir=str(WIKITEXT),
        train_split="valid",
        valid_split="test",
        seq_len=32,
        vocab_cap=2000,
        max_train_tokens=20_000,
    )
    task = build_task(cfg, seed=0)
    assert isinstance(task, LMTask)
    return task


def test_wikitext_shapes_vocab_and_shift(wikitext_task: LMTask) -> None:
    task = wikitext_task
    assert task.train_ids.numel() == 20_000
    assert task.vocab_size == 2001
    assert task.vocab[0] == "<unk>" and "<eos>" in task.vocab
    x, y = task.train_batch(16, _gen(3))
    _check_batch(x, y, 16, 32, task.vocab_size)
    assert torch.equal(x[:, 1:], y[:, :-1])

    # Vocabulary = the 2000 most frequent tokens of the first 20k training tokens.
    words = _reference_words(WIKITEXT / "valid.txt")[:20_000]
    counts = Counter(w for w in words if w != "<unk>")
    top = sorted(counts, key=lambda w: (-counts[w], w))[:2000]
    assert list(task.vocab[1:]) == top
    stoi = {w: i for i, w in enumerate(task.vocab)}
    assert task.train_ids.tolist() == [stoi.get(w, 0) for w in words]

    # Test-split words beyond the training prefix's vocabulary are <unk>.
    test_words = _reference_words(WIKITEXT / "test.txt")
    assert task.valid_ids.tolist()[:5000] == [stoi.get(w, 0) for w in test_words[:5000]]
    assert int((task.valid_ids == 0).sum()) > sum(1 for w in test_words if w == "<unk>")


def test_wikitext_valid_batches_fixed_and_consecutive(wikitext_task: LMTask) -> None:
    task = wikitext_task
    first = task.valid_batches(8)
    assert _same(first, task.valid_batches(8))
    assert len(first) == MAX_VALID_BATCHES  # the test split is long enough to hit the cap
    xs = torch.cat([x for x, _ in first]).flatten()
    ys = torch.cat([y for _, y in first]).flatten()
    n = xs.numel()
    assert n == MAX_VALID_BATCHES * 8 * 32
    assert torch.equal(xs, task.valid_ids[:n])
    assert torch.equal(ys, task.valid_ids[1 : n + 1])
    for x, y in first:
        _check_batch(x, y, 8, 32, task.vocab_size)


def test_wikitext_generator_reproducibility(wikitext_task: LMTask) -> None:
    task = wikitext_task
    g = _gen(11)
    state = g.get_state()
    torch.manual_seed(0)
    global_state = torch.get_rng_state()
    a = task.train_batch(4, g)
    assert torch.equal(torch.get_rng_state(), global_state)  # global RNG untouched
    b = task.train_batch(4, g)
    assert not torch.equal(a[0], b[0])
    g.set_state(state)
    again = task.train_batch(4, g)
    assert torch.equal(a[0], again[0]) and torch.equal(a[1], again[1])
    other = task.train_batch(4, _gen(12))
    assert not torch.equal(a[0], other[0])


# --------------------------------------------------------------------------------------------
# Synthetic tasks
# --------------------------------------------------------------------------------------------


def test_associative_recall_examples_parse() -> None:
    cfg = TaskConfig(kind="associative_recall", seq_len=24, n_symbols=10, n_pairs=6)
    task = build_task(cfg, seed=5)
    assert isinstance(task, AssociativeRecallTask)
    assert task.known_optimum == 0.0
    n = cfg.n_symbols
    assert task.vocab_size == 2 * n + 2
    query, pad = 2 * n, 2 * n + 1
    x, y = task.train_batch(64, _gen(0))
    _check_batch(x, y, 64, 24, task.vocab_size)
    assert (y[:, :-1] == IGNORE_INDEX).all()
    queried_positions: set[int] = set()
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        body = [t for t in xr if t != pad]
        assert xr[: 24 - len(body)] == [pad] * (24 - len(body))  # left padding only
        assert len(body) == 2 * 6 + 2
        pairs, marker, key = body[:-2], body[-2], body[-1]
        assert marker == query
        keys, values = pairs[0::2], pairs[1::2]
        assert all(0 <= k < n for k in keys) and all(n <= v < 2 * n for v in values)
        assert len(set(keys)) == len(keys)
        assert key in keys
        queried_positions.add(keys.index(key))
        assert yr[-1] == values[keys.index(key)]
    assert len(queried_positions) > 1  # the queried pair varies


def _split_seq2seq(
    x: Tensor, y: Tensor, seq_len: int, n_symbols: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """Parse rows into (source, answer in x, answer in y) and check the padding/separator."""
    length = (seq_len - 1) // 2
    pad = seq_len - (2 * length + 1)
    out = []
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        assert xr[:pad] == [n_symbols + 1] * pad
        assert xr[pad + length] == n_symbols  # separator
        source = xr[pad : pad + length]
        answer_x = xr[pad + length + 1 :]
        taken = [(t, v) for t, v in enumerate(yr) if v != IGNORE_INDEX]
        # targets sit at positions sep .. second-to-last answer token
        assert [t for t, _ in taken] == list(range(pad + length, pad + 2 * length))
        out.append((source, answer_x, [v for _, v in taken]))
    return out


@pytest.mark.parametrize("seq_len", [4, 9, 64])
def test_sort_targets_are_sorted_input(seq_len: int) -> None:
    task = build_task(TaskConfig(kind="sort", seq_len=seq_len, n_symbols=7), seed=0)
    assert isinstance(task, SortTask)
    assert task.known_optimum == 0.0 and task.vocab_size == 9
    x, y = task.train_batch(32, _gen(2))
    _check_batch(x, y, 32, seq_len, task.vocab_size)
    for source, answer_x, answer_y in _split_seq2seq(x, y, seq_len, 7):
        assert len(source) == (seq_len - 1) // 2
        assert all(0 <= s < 7 for s in source)
        assert answer_y == sorted(source)
        assert answer_x == sorted(source)


@pytest.mark.parametrize("seq_len", [5, 10, 33])
def test_copy_targets_are_input(seq_len: int) -> None:
    task = build_task(TaskConfig(kind="copy", seq_len=seq_len, n_symbols=5), seed=0)
    assert isinstance(task, CopyTask)
    assert task.known_optimum == 0.0 and task.vocab_size == 7
    x, y = task.train_batch(32, _gen(2))
    _check_batch(x, y, 32, seq_len, task.vocab_size)
    rows = _split_seq2seq(x, y, seq_len, 5)
    for source, answer_x, answer_y in rows:
        assert answer_y == source and answer_x == source
    assert len({tuple(s) for s, _, _ in rows}) > 1


@pytest.mark.parametrize("kind", ["associative_recall", "sort", "copy"])
def test_synthetic_reproducibility_and_valid_set(kind: str) -> None:
    cfg = TaskConfig.model_validate({"kind": kind, "seq_len": 20, "n_valid": 50})
    task = build_task(cfg, seed=7)

    g = _gen(123)
    state = g.get_state()
    global_state = torch.get_rng_state()
    a = task.train_batch(16, g)
    assert torch.equal(torch.get_rng_state(), global_state)
    b = task.train_batch(16, g)
    assert not torch.equal(a[0], b[0])
    g.set_state(state)
    again = task.train_batch(16, g)
    assert torch.equal(a[0], again[0]) and torch.equal(a[1], again[1])
    assert not torch.equal(a[0], task.train_batch(16, _gen(124))[0])

    # Validation: fixed, covers n_valid examples, batch-size independent, seed dependent.
    v1 = task.valid_batches(16)
    assert _same(v1, task.valid_batches(16))
    assert [x.shape[0] for x, _ in v1] == [16, 16, 16, 2]
    for x, y in v1:
        _check_batch(x, y, x.shape[0], 20, task.vocab_size)
    whole = torch.cat([x for x, _ in v1])
    assert torch.equal(whole, torch.cat([x for x, _ in task.valid_batches(7)]))
    assert _same(v1, build_task(cfg, seed=7).valid_batches(16))
    assert not torch.equal(
        whole, torch.cat([x for x, _ in build_task(cfg, seed=8).valid_batches(16)])
    )
    # Building the validation set leaves the global RNG alone.
    global_state = torch.get_rng_state()
    build_task(cfg, seed=9).valid_batches(16)
    assert torch.equal(torch.get_rng_state(), global_state)


@pytest.mark.parametrize("seq_len", [10, 24])
def test_associative_recall_attention_targets_point_at_the_answer(seq_len: int) -> None:
    """The target position of the query (the last position) holds the answer token: the
    label y[:, -1] itself, read back from x at that position, and it is the value right after
    the queried key; every other query has none (-1)."""
    cfg = TaskConfig(kind="associative_recall", seq_len=seq_len, n_symbols=6, n_pairs=4)
    task = build_task(cfg, seed=3)
    x, y = task.train_batch(128, _gen(4))
    targets = task.attention_targets(x)
    assert targets is not None and targets.shape == x.shape
    assert (targets[:, :-1] == -1).all()
    pos = targets[:, -1]
    assert ((pos >= 1) & (pos < seq_len - 2)).all()
    rows = torch.arange(x.shape[0])
    assert (x[rows, pos] == y[:, -1]).all()  # the token there is the answer
    assert (x[rows, pos - 1] == x[:, -1]).all()  # right after the queried key
    assert len(set(pos.tolist())) > 1
    with pytest.raises(ValueError, match="occur once"):
        task.attention_targets(torch.zeros_like(x))


@pytest.mark.parametrize("kind", ["sort", "copy"])
def test_tasks_without_an_answer_key_have_no_attention_targets(kind: str) -> None:
    task = build_task(TaskConfig(kind=kind, seq_len=9), seed=0)
    x, _ = task.train_batch(4, _gen(0))
    assert task.attention_targets(x) is None
