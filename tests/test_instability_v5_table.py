"""scripts/instability_v5_table.py's rules (docs/reproductions.md 9.1) on made-up numbers, and
the unigram floor it reads against an independent count of the corpus."""

from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import instability_table as it  # noqa: E402
import instability_v5_table as v5  # noqa: E402


def _paired(diffs: list[float]) -> it.Paired:
    zero = dict.fromkeys(range(len(diffs)), 0.0)
    return it.paired(dict(enumerate(diffs)), zero)


def test_testable_is_the_seed_median_below_the_floor_by_a_quarter_nat() -> None:
    assert v5.is_testable([2.7, 2.8, 3.5, 3.6, 2.9], 3.474)  # median 2.9 < 3.224
    assert not v5.is_testable([3.3, 3.2, 3.25], 3.474)  # median 3.25 >= 3.224
    assert not v5.is_testable([3.224] * 3, 3.474)


def test_primary_verdict_reads_the_interval() -> None:
    assert v5.primary_verdict(_paired([-0.30, -0.25, -0.28, -0.31, -0.27])) == "reproduced"
    assert v5.primary_verdict(_paired([0.30, 0.25, 0.28, 0.31, 0.27])) == "not reproduced"
    assert v5.primary_verdict(_paired([-0.3, 0.25, -0.1, 0.2, 0.0])) == "inconclusive"


def test_secondary_verdict_reads_holm_and_the_sign() -> None:
    down = _paired([-0.30, -0.25, -0.28, -0.31, -0.27])
    assert v5.secondary_verdict(down, 0.01) == "lowers LR sensitivity"
    assert v5.secondary_verdict(_paired([0.3, 0.25, 0.28, 0.31, 0.27]), 0.01) == (
        "raises LR sensitivity"
    )
    assert v5.secondary_verdict(down, 0.06) == "inconclusive"


def test_the_floor_of_the_definitions_is_the_unigram_cross_entropy_of_the_words() -> None:
    """Counted here from the raw text, independently of workers/tasks_lm.py: the 500 most
    frequent words of valid.txt (ties by string) plus <unk> for the rest (and a literal
    <unk>), <eos> at each line's end; targets: the first 2 x 8 windows of 32 of test.txt,
    shifted by one."""
    data = v5.DATA / "wikitext-2"
    if not (data / "valid.txt").exists():
        pytest.skip("WikiText-2 is not beside the checkout")

    def words(text: str) -> list[str]:
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        return [w for line in lines for w in [*line.split(), "<eos>"]]

    train = words((data / "valid.txt").read_text())
    counts = collections.Counter(w for w in train if w != "<unk>")
    vocab = {w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:500]}
    ids = [w if w in vocab else "<unk>" for w in train]
    freq = collections.Counter(ids)
    n, v = len(ids), len(vocab) + 1
    test = [w if w in vocab else "<unk>" for w in words((data / "test.txt").read_text())]
    per_batch = []
    for b in range(2):
        targets = [test[(b * 8 + i) * 32 + 1 : (b * 8 + i) * 32 + 33] for i in range(8)]
        flat = [t for row in targets for t in row]
        per_batch.append(-sum(math.log((freq[t] + 1) / (n + v)) for t in flat) / len(flat))
    want = sum(per_batch) / 2
    got = v5.floor_of_definition(v5.ROOT / "study_defs" / "instability_v5_none.yaml")
    assert got == pytest.approx(want, rel=1e-9)
    assert 3.4 < got < 3.55  # the review's 3.474
