"""The data forms end to end on a real local Ray head, through REST, on SQLite: a study on the
real WikiText-2 with a byte-level BPE trained by its trials (once, shared through the data
directory's cache), and a study whose second data directory holds a token id past the
vocabulary beyond what the API scans at POST: that trial FAILS with the reason, the other
completes, and the study is not failed. Both studies run at once."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.control.ray_cluster import LocalRayHead
from tests.data_helpers import WIKITEXT, bin_dir, wikitext
from tests.service.helpers import settings_for, wait_for
from workers.data.cache import CACHE_SUBDIR
from workers.data.layout import POST_SCAN_TOKENS

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not WIKITEXT.is_dir(), reason="WikiText-2 not available"),
]

TINY = {
    "model": {"n_layers": 1, "n_heads": 2, "d_model": 32, "d_ff": 64},
    "batch_size": 8,
    "steps": 20,
    "eval_every": 10,
    "eval_batches": 2,
    "probe_batch_size": 2,
}


def test_bpe_study_completes_and_a_bad_bin_fails_only_its_trial(
    ray_head: LocalRayHead, tmp_path: Path
) -> None:
    root = tmp_path / "data"
    corpus = root / "wikitext-2"
    corpus.mkdir(parents=True)
    for split in ("valid", "test"):  # a copy: the trials write their cache beside it
        shutil.copyfile(WIKITEXT / f"{split}.txt", corpus / f"{split}.txt")
    ids = np.frombuffer(wikitext("valid").encode(), np.uint8)
    test_ids = np.frombuffer(wikitext("test").encode(), np.uint8)[:100_000]
    bin_dir(root / "bytes-good", valid=ids, test=test_ids)
    bad = np.resize(ids, POST_SCAN_TOKENS + 1000).astype(np.uint16)
    bad[POST_SCAN_TOKENS + 500] = 300  # past vocab_size 256, beyond the POST scan
    bin_dir(root / "bytes-bad", valid=bad, test=test_ids)

    bpe = {
        "name": "wikitext-bpe",
        "description": "BPE-512 on WikiText-2 (train valid.txt, evaluate test.txt)",
        "base": {
            "task": {
                "kind": "lm",
                "data_dir": "wikitext-2",
                "train_split": "valid",
                "valid_split": "test",
                "tokenizer": "bpe",
                "vocab_size": 512,
                "seq_len": 32,
            },  # fmt: skip
            **TINY,
        },
        "search_space": {"optim.lr": {"type": "categorical", "choices": [0.01, 0.005]}},
        "sampler": {"kind": "grid"},
        "budget": {"n_trials": 2},
    }
    bins = {
        "name": "bin-with-a-bad-file",
        "base": {
            "task": {
                "kind": "lm",
                "data_dir": "bytes-good",
                "format": "bin",
                "vocab_size": 256,
                "train_split": "valid",
                "valid_split": "test",
                "seq_len": 32,
            },  # fmt: skip
            **TINY,
        },
        "search_space": {
            "task.data_dir": {"type": "categorical", "choices": ["bytes-good", "bytes-bad"]}
        },
        "sampler": {"kind": "grid"},
        "budget": {"n_trials": 2},
        "max_retries": 0,
    }
    settings = settings_for(
        f"sqlite:///{tmp_path / 'qkscope.db'}", ray_head, tmp_path, data_dir=str(root)
    )
    # the reconciler on (every second), as the service runs: a submission a loaded head
    # refused is made again (one fresh-clone run spent 581 s in this test before its rerun
    # passed; the first failure's message was not kept)
    with TestClient(create_app(settings)) as c:
        ids_ = []
        for body in (bpe, bins):
            r = c.post("/v1/studies", json=body)
            assert r.status_code == 201, r.text
            ids_.append(r.json()["id"])
        done = [wait_for(c, sid, {"COMPLETED", "FAILED", "CANCELLED"}, 300) for sid in ids_]

        # the BPE study: both trials trained on the BPE, trained once for both
        assert done[0]["status"] == "COMPLETED", done[0]
        trials = c.get(f"/v1/studies/{ids_[0]}/trials").json()["items"]
        assert [t["state"] for t in trials] == ["COMPLETE", "COMPLETE"], trials
        for t in trials:
            assert t["final_val_loss"] is not None and t["final_val_loss"] < math.log(512), t
        assert len(list((corpus / CACHE_SUBDIR).glob("bpe-*.json"))) == 1

        # the .bin study: the bad file fails its own trial, with the reason; the study goes on
        assert done[1]["status"] == "COMPLETED", done[1]
        trials = c.get(f"/v1/studies/{ids_[1]}/trials").json()["items"]
        by_dir = {t["params"]["task.data_dir"]: t for t in trials}
        good, failed = by_dir["bytes-good"], by_dir["bytes-bad"]
        assert good["state"] == "COMPLETE" and good["final_val_loss"] < math.log(256), good
        assert failed["state"] == "FAILED", failed
        error = failed["error"] or ""
        assert "task.vocab_size" in error and "past the vocabulary" in error, error
        assert f"token id 300 (at token {POST_SCAN_TOKENS + 500})" in error, error
