"""Benchmarks that cannot rot: every `bench/*.py` imports, and the cheap ones run at smoke
size (their figures are not checked: speed is a benchmark, not a test)."""

from __future__ import annotations

import importlib
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_imports(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    if name not in ("_common", "__main__"):
        assert callable(getattr(module, "main", None)), f"bench.{name} has no main()"


def _run(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_the_gpu_benchmark_runs_on_a_cpu_at_smoke_size() -> None:
    out = _run("bench.gpu", "--smoke")
    assert "(a) bare loop vs run_trial vs fused" in out and "(b) a study of small trials" in out
    assert "fused groups of 2" in out


def test_the_training_throughput_benchmark_runs_at_smoke_size() -> None:
    out = _run(
        "bench.train_throughput", "--quick", "--steps", "10", "--repeats", "1", "--threads", "1"
    )
    assert "run_trial tok/s" in out


@pytest.mark.cluster
def test_time_to_target_runs_qkscope_and_optuna_at_smoke_size(
    ray_head: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figure a user cares about: a study through REST and plain Optuna beside it, at a
    few seconds per framework. The service is the app on the suite's shared Ray head
    (`--api`); the benchmark's own `qkscope serve` start is the path test_cli proves."""
    from service.config import Settings
    from tests.conftest import SHARED
    from tests.service.conftest import live_api

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ttt.db'}",
        ray_address=ray_head.dashboard_url,
        home=tmp_path,
        checkpoint_dir=str(tmp_path / "ckpt"),
        data_dir=str(SHARED / "data"),
    )
    with live_api(settings, monkeypatch) as url:
        out = _run(
            "bench.time_to_target",
            *("--seeds", "1", "--budget", "6", "--steps", "30", "--only", "qkscope,optuna"),
            *("--api", url),
        )
    lines = {ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("| ")}
    assert {"qkscope", "optuna"} <= lines, out


def test_the_time_to_target_interval_brackets_the_ratio_of_medians() -> None:
    """`ratio_interval` resamples seeds: constant samples give the exact ratio, and a peer
    that never reached the target has no upper bound."""
    import math

    from bench.time_to_target import ratio_interval

    assert ratio_interval([10.0] * 5, [25.0] * 5) == (2.5, 2.5)
    lo, hi = ratio_interval([10.0, 12.0, 30.0], [20.0, 40.0, math.inf], draws=2000)
    assert 20.0 / 30.0 <= lo <= 1.0 and hi == math.inf
    lo, hi = ratio_interval([10.0, 20.0, 30.0, 40.0, 50.0], [20.0, 40.0, 60.0, 80.0, 100.0])
    assert lo < 2.0 < hi  # the medians' ratio, 2, lies inside


def test_time_to_target_quartiles_match_numpy_and_sort_misses_last() -> None:
    """The IQR column: numpy's linear percentiles where every run reached the target, and a
    run that never did (inf) counts as slower than all that did."""
    import math

    import numpy as np

    from bench.time_to_target import quartiles

    xs = [3.0, 9.5, 1.2, 7.7, 4.4, 20.0, 2.5]
    assert quartiles(xs) == pytest.approx(tuple(np.percentile(xs, [25, 50, 75])))
    assert quartiles([1.0, 2.0, 3.0, math.inf]) == (1.75, 2.5, math.inf)
    assert quartiles([math.inf] * 3) == (math.inf,) * 3


def test_time_to_target_counts_only_feasible_hits_within_budget_per_target() -> None:
    from bench.time_to_target import End, time_to_target

    ends = [End(2.0, 2.40, False, 1.0), End(5.0, 2.49, True, 1.0), End(9.0, 2.41, True, 1.0)]
    assert time_to_target(ends, 60.0, 2.5) == 5.0  # the infeasible 2.40 does not count
    assert time_to_target(ends, 60.0, 2.45) == 9.0
    assert time_to_target(ends, 8.0, 2.45) == math.inf


def test_time_to_target_workloads_read_their_constraints_as_optuna_does() -> None:
    """A constraint value is <= 0 exactly where the bound holds, for both directions; a
    metric the trial never reported (or a non-finite one) is a violation."""
    from types import SimpleNamespace

    from bench.time_to_target import WORKLOADS

    wl = WORKLOADS["llama"]  # min_norm_entropy_ever >= 0.1, max_attn_logit_ever <= 50
    ok = SimpleNamespace(min_norm_entropy_ever=0.3, max_attn_logit_ever=12.0)
    assert wl.violations(ok) == pytest.approx([-0.2, -38.0]) and wl.feasible(ok)
    hot = SimpleNamespace(min_norm_entropy_ever=0.3, max_attn_logit_ever=3.8e6)
    assert wl.violations(hot)[1] > 0 and not wl.feasible(hot)
    gone = SimpleNamespace(min_norm_entropy_ever=None, max_attn_logit_ever=math.nan)
    assert min(wl.violations(gone)) > 0 and not wl.feasible(gone)
    assert set(WORKLOADS["quickstart"].targets) == set(wl.targets) == {"common", "hard"}


def test_the_torch_func_baseline_trains_what_the_fused_model_trains() -> None:
    """bench.func_baseline compares two forms of one program: from the same weights and
    batches, the vmap(functional_call) ensemble and qkscope's fused model give the same
    per-member losses after a few steps of training."""
    from bench.func_baseline import _fused_arms, config, members

    cfgs = members(config(quick=True), 3)
    fused_tps, vmap_tps, diff = _fused_arms(cfgs, 4)
    assert fused_tps > 0 and vmap_tps > 0
    assert diff < 1e-5


def test_the_orchestration_split_reads_fused_slots_without_negative_refills() -> None:
    """Four member slots in two workers: the old pairing (k-th start with the
    (k - 2)-th end) gave 0 - 5 = -5 s; FIFO pairing gives each freed slot's real wait."""
    from bench.orchestration import mean_in_flight, refill_gaps

    starts = [0.0, 0.0, 0.0, 0.0, 5.5, 6.0]
    ends = [5.0, 6.0, 7.0, 8.0, 10.0, 11.0]
    assert refill_gaps(starts, ends) == [0.5, 0.0]
    assert mean_in_flight(starts, ends) == (5 + 6 + 7 + 8 + 4.5 + 5) / 11
    # one trial per worker, two workers: every start after the first two waits its gap
    assert refill_gaps([0.0, 0.0, 3.2, 4.1], [3.0, 4.0, 6.0, 7.0]) == pytest.approx([0.2, 0.1])


def test_the_orchestration_ideal_of_a_fused_line_comes_from_trials_run_alone() -> None:
    """Fused members' own clocks overlap (each counts its mates' training), so their sum
    over-states the ideal: a fused line's ideal is its trials at a one-by-one line's cost."""
    from bench.orchestration import Result

    fused = Result("qkscope", 28.0, 24, [7.6] * 24, 0.0, {"in_flight": 5.6}, concurrency=2)
    alone = Result("plain Optuna", 35.0, 24, [2.8] * 24, 0.0, {}, concurrency=2)
    assert fused.fused and not alone.fused
    assert fused.ideal_s == pytest.approx(24 * 7.6 / 2)  # the members' clocks: wrong
    fused.alone_s = statistics.median(alone.compute_s)
    assert fused.ideal_s == pytest.approx(24 * 2.8 / 2) and alone.ideal_s == pytest.approx(33.6)
    assert fused.overhead_per_trial() == pytest.approx((28.0 - 33.6) / 24)
