"""`workers.fusion_plan.memory_estimate` (the POST-time memory check's figure, torch-free)
against real torch: a trial run in its own process never grows its peak resident memory past
the estimate, and the estimate is not wildly above it (it would refuse studies that fit)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from workers.config import TrialConfig
from workers.fusion_plan import memory_estimate

# Each config makes a different part the largest one.
CONFIGS: dict[str, dict[str, Any]] = {
    "activations": {
        "batch_size": 32,
        "task": {"kind": "copy", "seq_len": 256, "n_valid": 64},
        "model": {"n_heads": 8},
    },
    "recall": {
        "batch_size": 8,
        "task": {"kind": "associative_recall", "n_symbols": 1024, "n_valid": 20_000},
    },
    "sort": {"batch_size": 8, "task": {"kind": "sort", "seq_len": 1024, "n_valid": 10_000}},
    # Double precision: 8 bytes a number (issue 42: the estimate assumed 4 for every dtype,
    # and this trial grew past that estimate).
    "activations-float64": {
        "dtype": "float64",
        "batch_size": 32,
        "task": {"kind": "copy", "seq_len": 256, "n_valid": 64},
        "model": {"n_heads": 8},
    },
}

# The trial's own growth of resident memory: sampled every 2 ms from /proc while it runs,
# against the resident memory just before it (the process's high-water mark, ru_maxrss,
# can already stand above the trial's peak from imports, and then reads a growth of 0).
SCRIPT = """
import json, os, sys, threading, time
import torch
torch.set_num_threads(1)
from workers.config import TrialConfig
from workers.trial import run_trial
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
config = TrialConfig.model_validate(json.loads(sys.argv[1]))
before, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
t = threading.Thread(target=sample)
t.start()
run_trial(config)
done.set()
t.join()
print(json.dumps(max(peak[0], rss()) - before))
"""


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_estimate_bounds_a_real_trial(name: str) -> None:
    config = TrialConfig.model_validate(
        {"dtype": "float32", **CONFIGS[name], "steps": 3, "eval_every": 3, "device": "cpu"}
    )
    est = memory_estimate(config)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, config.model_dump_json(by_alias=True)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert grown <= est.total, (name, grown, est)
    # Within a factor of the estimate (first-touch libraries and allocator slack included).
    assert est.total <= 6 * max(grown, 32 * 2**20), (name, grown, est)


def test_the_lm_validation_bound_is_the_tasks_own() -> None:
    from workers.fusion_plan import LM_VALID_BATCHES
    from workers.tasks import MAX_VALID_BATCHES

    assert LM_VALID_BATCHES == MAX_VALID_BATCHES


def test_a_float64_trial_is_estimated_at_eight_bytes_a_number() -> None:
    """Every float part doubles from float32 to float64 (weights, gradients, moments,
    activations, logits, probe: `float_bytes`); the validation set holds token ids and does
    not. Counted here from the parts' own formulas at 4 bytes, independently of the code."""
    base = {**CONFIGS["activations"], "device": "cpu"}
    f32 = memory_estimate(TrialConfig.model_validate({**base, "dtype": "float32"}))
    f64 = memory_estimate(TrialConfig.model_validate({**base, "dtype": "float64"}))
    for part in ("parameters", "activations", "logits", "probe"):
        assert getattr(f64, part) == 2 * getattr(f32, part), part
    assert f64.validation == f32.validation
