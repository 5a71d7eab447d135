"""Tests for workers.trial: reproducibility, regularizers, resume, divergence, pruning, CLI.

Every trial here is tiny (d_model 32, 2 layers, tens of steps on a synthetic task) so the
file runs in seconds on two CPU cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import yaml

from service.store import jsonable
from tests.workers.helpers import TINY, Recorder, merge, tiny
from workers.tasks import build_task
from workers.trial import (
    TrialConfig,
    TrialSummary,
    build_model,
    probe_metrics,
    run_trial,
)

REPO = Path(__file__).resolve().parents[2]
WIKITEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"

# Fields of the summary that measure the machine, not the trial, and the config's hash (which
# differs between two configs that should train alike, e.g. lambda 0 vs no regularizer).
TIMING_FIELDS = {"wall_time_s", "tokens_per_s", "config_hash"}


Key = tuple[int, str, int | None, int | None]


def _summary_sans_timing(s: TrialSummary) -> dict[str, Any]:
    return {k: v for k, v in s.model_dump().items() if k not in TIMING_FIELDS}


# (a) ------------------------------------------------------------------------------------------


def test_same_config_and_seed_is_bit_identical_on_cpu() -> None:
    cfg = tiny(model={"qk_init_std": 0.2})
    r1, r2 = Recorder(), Recorder()
    s1, s2 = run_trial(cfg, r1), run_trial(cfg, r2)
    assert s1.status == s2.status == "completed"
    assert s1.val_losses == s2.val_losses  # exact float equality
    assert s1.final_train_loss == s2.final_train_loss
    assert s1.final_train_loss is not None and math.isfinite(s1.final_train_loss)
    assert r1.stream() == r2.stream()
    assert _summary_sans_timing(s1) == _summary_sans_timing(s2)

    s3 = run_trial(tiny(model={"qk_init_std": 0.2}, seed=1))
    assert s3.val_losses != s1.val_losses  # the seed matters


def test_eval_cadence_includes_final_step() -> None:
    rec = Recorder()
    s = run_trial(tiny(steps=12, eval_every=5), rec)
    assert rec.steps == [5, 10, 12]
    assert s.eval_steps == [5, 10, 12]
    assert s.steps_done == 12
    assert len(s.val_losses) == 3


# (b) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["spectral_variance", "locater"])
def test_lambda_zero_is_bit_identical_to_no_regularizer(kind: str) -> None:
    none_rec, zero_rec = Recorder(), Recorder()
    s_none = run_trial(tiny(model={"qk_init_std": 0.3}, regularizer={"kind": "none"}), none_rec)
    s_zero = run_trial(
        tiny(
            model={"qk_init_std": 0.3},
            regularizer={"kind": kind, "lambda": 0.0, "target_mean": 0.5},
        ),
        zero_rec,
    )
    assert zero_rec.stream() == none_rec.stream()
    assert _summary_sans_timing(s_zero) == _summary_sans_timing(s_none)


# (c) ------------------------------------------------------------------------------------------


def test_spectral_variance_penalty_lowers_qk_eigen_variance() -> None:
    # Measured (30 steps, qk_init_std 0.3, AdamW lr 1e-3): the final mean qk_eig_var is
    # 0.126-0.144 with lambda = 0 and 0.78-0.79 times that with lambda = 10 (seeds 0-3;
    # 0.85-0.88 with lambda = 1). Asserting < 0.9 leaves margin.
    base = {"model": {"qk_init_std": 0.3}, "steps": 30, "eval_every": 10}
    rec0, rec1 = Recorder(), Recorder()
    s0 = run_trial(tiny(**base), rec0)
    s1 = run_trial(tiny(**base, regularizer={"kind": "spectral_variance", "lambda": 10.0}), rec1)
    assert s0.qk_eig_var is not None and s1.qk_eig_var is not None
    assert s1.qk_eig_var < 0.9 * s0.qk_eig_var, (s0.qk_eig_var, s1.qk_eig_var)
    # the summary's number is the mean over layers and heads of the final evaluation
    final = rec1.at(30)
    per_head = [v for (name, _, _), v in final.items() if name == "qk_eig_var"]
    assert s1.qk_eig_var == pytest.approx(sum(per_head) / len(per_head), rel=1e-12)
    # the mean over each head's rank, beside the D-mean: the mean of its per-head rows, and
    # tr(W)/d_h = (tr(W)/D) * D/d_h head by head (tiny(): d_model 16, 2 heads of 8)
    rank_means = [v for (name, _, _), v in final.items() if name == "qk_eig_mean_rank"]
    assert s1.qk_eig_mean_rank == pytest.approx(sum(rank_means) / len(rank_means), rel=1e-12)
    assert s1.qk_eig_mean is not None and s1.qk_eig_mean_rank is not None
    assert s1.qk_eig_mean_rank == pytest.approx(s1.qk_eig_mean * 16 / 8, rel=1e-5, abs=1e-9)
    # the regularized run reports its penalty; the plain one does not
    assert ("reg_penalty", None, None) in final
    assert ("reg_penalty", None, None) not in rec0.at(30)


# (d) ------------------------------------------------------------------------------------------


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize(
    ("crash", "k"),
    [("reporter", 15), ("progress", 12)],
    ids=["crash-in-report-at-eval-15", "crash-mid-interval-at-12"],
)
def test_checkpoint_resume_matches_uninterrupted_run(tmp_path: Path, crash: str, k: int) -> None:
    over = {"model": {"qk_init_std": 0.2}, "regularizer": {"kind": "locater", "lambda": 0.1}}
    rec_a = Recorder()
    s_a = run_trial(tiny(**over, checkpoint={"dir": str(tmp_path / "a")}), rec_a)
    assert s_a.status == "completed" and rec_a.steps == [5, 10, 15, 20]

    cfg_b = tiny(**over, checkpoint={"dir": str(tmp_path / "b")})
    if crash == "reporter":
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_trial(cfg_b, Recorder(crash_at_step=k))
    else:

        def boom(step: int) -> None:
            if step == k:
                raise _Crash(f"simulated crash at step {step}")

        with pytest.raises(_Crash):
            run_trial(cfg_b, Recorder(), progress=boom)
    assert (tmp_path / "b" / "checkpoint.pt").exists()
    last_ckpt = 10  # the checkpoint follows each report, so a crash at 12 or in report 15 -> 10

    rec_b = Recorder()
    s_b = run_trial(cfg_b, rec_b)
    assert rec_b.steps == [s for s in rec_a.steps if s > last_ckpt]
    assert rec_b.stream() == rec_a.stream(after=last_ckpt)
    assert k in rec_b.steps or k not in rec_a.steps
    assert _summary_sans_timing(s_b) == _summary_sans_timing(s_a)
    assert s_b.steps_done == 20 and s_b.eval_steps == [5, 10, 15, 20]


def test_completed_checkpoint_rerun_returns_same_summary(tmp_path: Path) -> None:
    cfg = tiny(checkpoint={"dir": str(tmp_path)})
    s1 = run_trial(cfg)
    rec = Recorder()
    s2 = run_trial(cfg, rec)
    assert rec.reports == []  # nothing left to train
    assert _summary_sans_timing(s2) == _summary_sans_timing(s1)


# (e) ------------------------------------------------------------------------------------------


def test_divergence_is_reported_not_raised() -> None:
    # Measured: plain SGD at lr 10 without clipping blows up within a handful of steps
    # (val loss ~3e3 at step 2, ~6e7 at step 4, non-finite by step 6).
    rec = Recorder()
    s = run_trial(
        tiny(
            optim={"name": "sgd", "lr": 10.0, "grad_clip": None, "schedule": "constant"},
            steps=200,
            eval_every=2,
        ),
        rec,
    )
    assert s.status == "diverged"
    assert s.diverged_at_step is not None and 0 < s.diverged_at_step < 200
    assert s.steps_done < 200
    # metrics measured before the divergence are kept, in the summary and in the reports
    assert len(s.eval_steps) >= 1 and rec.steps[: len(s.eval_steps)] == s.eval_steps
    assert all(step <= s.diverged_at_step for step in s.eval_steps)
    assert s.val_losses[0] is not None and math.isfinite(s.val_losses[0])
    assert s.best_val_loss is not None and math.isfinite(s.best_val_loss)
    # the summary has no non-finite floats (they become None) but the running maxima of
    # METRICS.md 9, where a non-finite value counts as +inf; stored, that is "inf"
    for name, value in s.model_dump().items():
        if isinstance(value, float) and not math.isfinite(value):
            assert name in ("max_attn_logit_ever", "max_abs_output_log_z_ever")
            assert value == math.inf
    json.dumps(jsonable(s.model_dump(mode="json")), allow_nan=False)


# (f) ------------------------------------------------------------------------------------------


def test_reporter_can_prune() -> None:
    rec = Recorder(stop_at_report=2)
    s = run_trial(tiny(steps=40, eval_every=5), rec)
    assert s.status == "pruned"
    assert s.steps_done == 10
    assert rec.steps == [5, 10]
    assert s.eval_steps == [5, 10]
    assert s.diverged_at_step is None


# (g) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_layers", "n_heads"), [(2, 2), (1, 4)])
def test_reporter_receives_every_metric(n_layers: int, n_heads: int) -> None:
    rec = Recorder()
    run_trial(tiny(model={"n_layers": n_layers, "n_heads": n_heads}, steps=10), rec)
    assert rec.steps == [5, 10]
    expected: set[tuple[str, int | None, int | None]] = {
        ("train_loss", None, None),
        ("val_loss", None, None),
        ("grad_norm", None, None),
        ("lr", None, None),
        ("output_log_z", None, None),
    }
    for layer in range(1, n_layers + 1):
        for head in range(n_heads):
            for name in (
                "attn_entropy",
                "attn_entropy_norm",
                "qk_eig_mean",
                "qk_eig_var",
                "qk_eig_mean_rank",
                "qk_eff_eig_mean",  # Pre-LN (the default): the form diag(g) W diag(g)
                "qk_eff_eig_var",
                "attn_top1_mass",
                "attn_target_mass",  # associative recall knows the answer's position
                "attn_logit_max",  # METRICS.md 9
            ):
                expected.add((name, layer, head))
    for layer in range(n_layers + 1):
        expected.add(("rank_ratio", layer, None))
    for step, points in rec.reports:
        keys = [(p.name, p.layer, p.head) for p in points]
        assert len(keys) == len(set(keys)), f"duplicate metric at step {step}"
        assert set(keys) == expected  # no regularizer: exactly these, nothing missing
        for p in points:
            assert isinstance(p.value, float) and math.isfinite(p.value), p
        values = rec.at(step)
        for layer in range(1, n_layers + 1):
            for head in range(n_heads):
                assert 0.0 <= values[("attn_entropy_norm", layer, head)] <= 1.0 + 1e-6
                assert values[("attn_entropy", layer, head)] >= 0.0
                assert values[("qk_eig_var", layer, head)] >= -1e-6
                assert 0.0 <= values[("attn_top1_mass", layer, head)] <= 1.0
                assert 0.0 <= values[("attn_target_mass", layer, head)] <= 1.0
        assert values[("lr", None, None)] > 0.0
        assert values[("grad_norm", None, None)] > 0.0


# (h) ------------------------------------------------------------------------------------------


def test_cli_prints_json_summary(tmp_path: Path) -> None:
    cfg_path = tmp_path / "trial.yaml"
    cfg_path.write_text(yaml.safe_dump(merge(TINY, {"steps": 10})))
    proc = subprocess.run(
        [sys.executable, "-m", "workers.trial", str(cfg_path)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "completed"
    assert summary["steps_done"] == 10
    assert summary["eval_steps"] == [5, 10]
    TrialSummary.model_validate(summary)


def test_cli_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "workers.trial"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "usage" in proc.stderr


# (i) ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (WIKITEXT / "valid.txt").is_file(), reason="WikiText-2 data not present")
def test_lm_trial_on_wikitext2() -> None:
    rec = Recorder()
    cfg = tiny(
        task={
            "kind": "lm",
            "data_dir": str(WIKITEXT),
            "train_split": "valid",
            "valid_split": "test",
            "seq_len": 32,
            "vocab_cap": 2000,
            "max_train_tokens": 20000,
        },
        steps=10,
        eval_every=5,
    )
    s = run_trial(cfg, rec)
    assert s.status == "completed"
    assert s.steps_done == 10
    assert s.final_train_loss is not None and math.isfinite(s.final_train_loss)
    assert all(v is not None and math.isfinite(v) for v in s.val_losses)
    # a fresh model is close to uniform over the 2001-token vocabulary (log 2001 = 7.6 nats)
    assert s.val_losses[0] is not None and 5.0 < s.val_losses[0] < 9.0
    assert s.trapped is False  # no known optimum, no study reference


# (j) eval_at_init ------------------------------------------------------------------------------

INIT_KEYS_ABSENT = {("train_loss", None, None), ("grad_norm", None, None)}
INIT_FIELDS = {"init_val_loss", "init_min_norm_entropy", "init_rank_ratio", "init_qk_eig_var"}


def test_eval_at_init_reports_step_zero_and_leaves_training_unchanged() -> None:
    over = {"model": {"qk_init_std": 0.3}, "regularizer": {"kind": "locater", "lambda": 0.1}}
    plain, init = Recorder(), Recorder()
    s_plain = run_trial(tiny(**over), plain)
    s_init = run_trial(tiny(**over, eval_at_init=True), init)

    assert init.steps == [0, 5, 10, 15, 20]
    assert plain.steps == [5, 10, 15, 20]
    # step 0 measures the untrained model: everything but the training-only scalars
    first = init.at(0)
    assert INIT_KEYS_ABSENT.isdisjoint(first)
    assert set(first) == set(init.at(5)) - INIT_KEYS_ABSENT
    assert all(math.isfinite(v) for v in first.values())
    assert first[("lr", None, None)] > 0.0
    # evaluating draws no randomness: the training run is bit-identical
    assert init.stream(after=0) == plain.stream()

    # every pre-existing summary field means what it meant: same values, steps >= 1 only
    d_plain, d_init = _summary_sans_timing(s_plain), _summary_sans_timing(s_init)
    assert {k: v for k, v in d_init.items() if k not in INIT_FIELDS} == {
        k: v for k, v in d_plain.items() if k not in INIT_FIELDS
    }
    assert s_init.eval_steps == [5, 10, 15, 20]
    assert all(d_plain[k] is None for k in INIT_FIELDS)
    # the init_* fields are the final ones' reductions, applied to the step-0 report
    assert s_init.init_val_loss == first[("val_loss", None, None)]
    assert s_init.init_rank_ratio == first[("rank_ratio", 2, None)]
    assert s_init.init_min_norm_entropy == min(
        v for (name, _, _), v in first.items() if name == "attn_entropy_norm"
    )
    var = [v for (name, _, _), v in first.items() if name == "qk_eig_var"]
    assert s_init.init_qk_eig_var == pytest.approx(sum(var) / len(var), rel=1e-12)


def test_eval_at_init_measures_the_untrained_model() -> None:
    cfg = tiny(model={"qk_init_std": 0.5}, eval_at_init=True, steps=5)
    rec = Recorder()
    run_trial(cfg, rec)
    # the same probe, taken directly from a freshly built model with the trial's seed
    task = build_task(cfg.task, cfg.seed)
    model = build_model(cfg, task)
    probe_x, _ = task.train_batch(
        cfg.probe_batch_size, torch.Generator().manual_seed(cfg.seed + 7919)
    )
    expected = {(p.name, p.layer, p.head): p.value for p in probe_metrics(model, probe_x)}
    got = rec.at(0)
    assert {k: got[k] for k in expected} == expected


@pytest.mark.parametrize(
    ("crash_step", "last_ckpt"),
    [(3, 0), (12, 10)],
    ids=["crash-before-first-training-eval", "crash-after-eval-10"],
)
def test_eval_at_init_is_not_reported_again_after_resume(
    tmp_path: Path, crash_step: int, last_ckpt: int
) -> None:
    over = {"model": {"qk_init_std": 0.2}, "eval_at_init": True}
    rec_a = Recorder()
    s_a = run_trial(tiny(**over, checkpoint={"dir": str(tmp_path / "a")}), rec_a)
    assert rec_a.steps == [0, 5, 10, 15, 20]

    cfg_b = tiny(**over, checkpoint={"dir": str(tmp_path / "b")})

    def boom(step: int) -> None:
        if step == crash_step:
            raise _Crash(f"simulated crash at step {step}")

    first = Recorder()
    with pytest.raises(_Crash):
        run_trial(cfg_b, first, progress=boom)
    assert first.steps[0] == 0  # step 0 was reported (and checkpointed) before the crash

    rec_b = Recorder()
    s_b = run_trial(cfg_b, rec_b)
    assert 0 not in rec_b.steps
    assert rec_b.steps == [s for s in rec_a.steps if s > last_ckpt]
    assert rec_b.stream() == rec_a.stream(after=last_ckpt)
    # the resumed summary still carries the step-0 numbers, from the checkpoint
    assert _summary_sans_timing(s_b) == _summary_sans_timing(s_a)
    assert s_b.init_rank_ratio is not None

    rerun = Recorder()
    assert _summary_sans_timing(run_trial(cfg_b, rerun)) == _summary_sans_timing(s_a)
    assert rerun.reports == []


def test_eval_at_init_can_be_pruned_before_training() -> None:
    rec = Recorder(stop_at_report=1)
    s = run_trial(tiny(eval_at_init=True, steps=40), rec)
    assert rec.steps == [0]
    assert s.status == "pruned" and s.steps_done == 0
    assert s.eval_steps == [] and s.final_val_loss is None
    assert s.init_val_loss is not None and s.init_rank_ratio is not None


def test_eval_at_init_off_by_default() -> None:
    assert TrialConfig().eval_at_init is False
    rec = Recorder()
    s = run_trial(tiny(steps=5), rec)
    assert rec.steps == [5]
    assert all(getattr(s, f) is None for f in INIT_FIELDS)


# ---- zero-step float64 probes, concentration series, provenance -----------------------------


def _rank_ratios(rec: Recorder, step: int) -> list[float]:
    got = rec.at(step)
    layers = sorted(k[1] for k in got if k[0] == "rank_ratio" and k[1] is not None)
    return [got[("rank_ratio", layer, None)] for layer in layers]


def test_a_zero_step_float64_trial_measures_only_the_untrained_model() -> None:
    """steps 0 + eval_at_init: one report (step 0), init fields set, no training fields; in
    float64 the bidirectional pure-attention ratio falls far below float32's floor (~1e-7),
    and the two precisions agree where float32 still resolves it."""
    over: dict[str, Any] = {
        "model": {"n_layers": 8, "block": "pure", "norm": "pre", "causal": False},
        "steps": 0,
        "eval_at_init": True,
    }
    rec64, rec32 = Recorder(), Recorder()
    s64 = run_trial(tiny(**over, dtype="float64"), rec64)
    run_trial(tiny(**over, dtype="float32"), rec32)
    assert rec64.steps == [0] and rec32.steps == [0]
    assert s64.status == "completed" and s64.steps_done == 0
    assert s64.eval_steps == [] and s64.final_val_loss is None and s64.final_rank_ratio is None
    assert s64.init_val_loss is not None and s64.init_rank_ratio is not None
    r64, r32 = _rank_ratios(rec64, 0), _rank_ratios(rec32, 0)
    assert len(r64) == 9  # the embedding and every layer
    assert min(r64) < 1e-12 < 1e-9 < min(r for r in r32 if r > 0)
    resolved = [(a, b) for a, b in zip(r64, r32, strict=True) if b > 1e-4]
    assert len(resolved) >= 2
    for a, b in resolved:
        assert a == pytest.approx(b, rel=1e-3)


def test_zero_steps_need_eval_at_init() -> None:
    with pytest.raises(pydantic.ValidationError, match="eval_at_init"):
        tiny(steps=0)
    assert tiny(steps=0, eval_at_init=True).steps == 0


def test_target_mass_is_stored_where_the_task_knows_the_answer_only() -> None:
    rec_ar = Recorder()
    s_ar = run_trial(tiny(steps=5, eval_at_init=True), rec_ar)
    for step in (0, 5):
        keys = {k[1:] for k in rec_ar.at(step) if k[0] == "attn_target_mass"}
        assert keys == {(layer, h) for layer in (1, 2) for h in (0, 1)}
        assert all(
            0.0 <= v <= 1.0 for k, v in rec_ar.at(step).items() if k[0] == "attn_target_mass"
        )
    assert s_ar.target_mass is not None and s_ar.top1_mass is not None
    rec_sort = Recorder()
    s_sort = run_trial(tiny(steps=5, task={"kind": "sort", "seq_len": 9}), rec_sort)
    assert not any(k[0] == "attn_target_mass" for k in rec_sort.at(5))
    assert any(k[0] == "attn_top1_mass" for k in rec_sort.at(5))
    assert s_sort.target_mass is None and s_sort.top1_mass is not None


def test_summary_carries_config_hash_and_code_commit(tmp_path: Path) -> None:
    a = run_trial(tiny(steps=5, checkpoint={"dir": str(tmp_path / "a")}))
    b = run_trial(tiny(steps=5, checkpoint={"dir": str(tmp_path / "b")}))
    c = run_trial(tiny(steps=5, seed=1))
    assert a.config_hash is not None and len(a.config_hash) == 16
    assert a.config_hash == b.config_hash != c.config_hash  # checkpoint location is no setting
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert a.code_commit is not None and a.code_commit.split("+")[0] == head
