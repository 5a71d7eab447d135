"""Stopping a trial that can no longer meet its study's constraints (workers/stopping.py):
which violations are final (from the metric registry), patience, and the engine stopping a
member exactly at the evaluation that ruled it out, alone and fused, without touching the
members that stay feasible."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.workers.helpers import Recorder, tiny
from workers.config import TrialConfig
from workers.fused import run_trial_group
from workers.metric_names import SUMMARIES
from workers.stopping import Stopper, StopRule, can_recover
from workers.trial import run_trial

EVER = StopRule("min_norm_entropy_ever", ">=", 0.1, patience=1)
FINAL = StopRule("min_norm_entropy", ">=", 0.1, patience=3)


def _cfg(qk_init_std: float, seed: int = 0) -> TrialConfig:
    # qk_init_std 1.5 collapses attention at the first evaluation (min normalised entropy
    # ~0.003-0.008 at step 5 for seeds 0 and 1), 0.02 keeps it near uniform (~0.8-1.0)
    return tiny(model={"qk_init_std": qk_init_std}, steps=40, eval_every=5, seed=seed)


def _min_entropies(rec: Recorder) -> list[tuple[int, float]]:
    return [
        (step, min(p.value for p in pts if p.name == "attn_entropy_norm"))
        for step, pts in rec.reports
    ]


@pytest.mark.parametrize(
    ("metric", "op", "recoverable"),
    [
        ("min_norm_entropy_ever", ">=", False),  # a running minimum below a lower bound
        ("min_norm_entropy_ever", "<=", True),
        ("best_val_loss", ">=", False),
        ("best_val_loss", "<=", True),
        ("min_norm_entropy", ">=", True),  # the last evaluation's: it may come back
        ("final_rank_ratio", ">=", True),
        ("plateau_count", "<=", True),
        ("max_attn_logit_ever", "<=", False),  # a running maximum above an upper bound
        ("max_attn_logit_ever", ">=", True),
        ("max_abs_output_log_z_ever", "<=", False),
        ("max_attn_logit", "<=", True),  # the last evaluation's: it may come back down
    ],
)
def test_which_violations_are_final_comes_from_the_registry(
    metric: str, op: str, recoverable: bool
) -> None:
    assert can_recover(metric, op) is recoverable  # type: ignore[arg-type]


def test_every_summary_says_how_it_moves() -> None:
    moves = {s.name: s.moves for s in SUMMARIES}
    assert moves["min_norm_entropy_ever"] == moves["best_val_loss"] == "down"
    assert moves["init_val_loss"] == "fixed" and moves["final_val_loss"] == "any"
    assert all(s.moves == "down" for s in SUMMARIES if s.over == "min")
    assert moves["max_attn_logit_ever"] == moves["max_abs_output_log_z_ever"] == "up"
    assert moves["max_attn_logit"] == "any"
    assert all(s.moves == "up" for s in SUMMARIES if s.over == "max")


def test_patience_counts_violations_in_a_row() -> None:
    stopper = Stopper([FINAL])
    seq = [0.05, 0.05, 0.2, 0.05, 0.05, 0.05]
    got = [
        stopper.check(10 * (i + 1), SimpleNamespace(min_norm_entropy=v)) for i, v in enumerate(seq)
    ]
    assert got[:5] == [None] * 5  # the run of two was broken by 0.2
    assert got[5] == "min_norm_entropy 0.05 < 0.1 at step 60 (3 evaluations in a row)"
    assert Stopper([EVER]).check(5, SimpleNamespace(min_norm_entropy_ever=None)) is None


def test_a_collapsed_trial_stops_at_the_first_evaluation_that_rules_it_out() -> None:
    cfg = _cfg(1.5)
    free, stopped = Recorder(), Recorder()
    whole = run_trial(cfg, free)
    first_bad = next(step for step, m in _min_entropies(free) if m < 0.1)
    out = run_trial(cfg, stopped, stop_rules=[EVER])
    assert whole.status == "completed" and whole.min_norm_entropy_ever < 0.1  # the premise
    assert out.status == "pruned" and out.steps_done == first_bad == 5
    assert out.stop_reason is not None
    assert (
        out.stop_reason.startswith("min_norm_entropy_ever 0.0")
        and "< 0.1 at step 5" in out.stop_reason
    )
    assert stopped.stream() == free.stream()[: len(stopped.stream())]  # the same evaluations
    assert stopped.steps == [5]


def test_a_reversible_violation_waits_for_its_patience() -> None:
    out = run_trial(_cfg(1.5), Recorder(), stop_rules=[FINAL])
    assert out.status == "pruned" and out.steps_done == 15
    assert out.stop_reason is not None and "(3 evaluations in a row)" in out.stop_reason


def test_a_healthy_trial_trains_exactly_as_without_rules() -> None:
    cfg = _cfg(0.02)
    plain, ruled = Recorder(), Recorder()
    a = run_trial(cfg, plain)
    b = run_trial(cfg, ruled, stop_rules=[EVER, FINAL])
    assert a.status == b.status == "completed" and b.stop_reason is None
    assert plain.stream() == ruled.stream()  # bit-identical: checking costs the trial nothing


def test_fused_members_stop_alone_and_the_others_go_on() -> None:
    wild, calm = _cfg(1.5, seed=1), _cfg(0.02, seed=1)
    alone = Recorder()
    run_trial(calm, alone)
    recs = [Recorder(), Recorder()]
    out = run_trial_group([wild, calm], recs, stop_rules=[EVER])
    assert [s.status for s in out] == ["pruned", "completed"]
    assert out[0].steps_done == 5 and recs[0].steps == [5]
    got, want = recs[1].stream(), alone.stream()
    assert [g[:4] for g in got] == [w[:4] for w in want]
    for g, w in zip(got, want, strict=True):  # fused vs alone: float32 rounding only
        assert math.isclose(g[4], w[4], rel_tol=1e-4, abs_tol=1e-6), (g, w)


def _max_logits(rec: Recorder) -> list[tuple[int, float]]:
    return [
        (step, max(p.value for p in pts if p.name == "attn_logit_max")) for step, pts in rec.reports
    ]


def test_a_running_maximum_of_the_attention_logits_stops_at_its_first_violation() -> None:
    """Wortsman et al.'s attention logit growth as a stop: at lr 0.01 the largest logit grows
    from ~0.3 to ~8 in 40 steps (dipping once on the way); `max_attn_logit_ever <= 4` stops the
    trial at the first evaluation above 4, with its reason, while the same bound on the last
    evaluation's value (which can come back down) waits for its patience."""
    cfg = tiny(steps=40, eval_every=5, optim={"lr": 0.01, "schedule": "constant"})
    free, stopped = Recorder(), Recorder()
    whole = run_trial(cfg, free)
    curve = _max_logits(free)
    first_bad = next(step for step, v in curve if v > 4.0)
    assert whole.max_attn_logit_ever is not None and whole.max_attn_logit_ever > 4.0  # premise
    assert whole.max_attn_logit_ever == max(v for _, v in curve)
    assert 5 < first_bad < 40
    rule = StopRule("max_attn_logit_ever", "<=", 4.0, patience=1)
    out = run_trial(cfg, stopped, stop_rules=[rule])
    assert out.status == "pruned" and out.steps_done == first_bad
    assert out.stop_reason is not None and out.stop_reason.startswith("max_attn_logit_ever ")
    assert f"> 4 at step {first_bad}" in out.stop_reason
    assert out.max_attn_logit_ever == dict(curve)[first_bad]
    assert stopped.stream() == free.stream()[: len(stopped.stream())]  # the same evaluations
    # the same bound on the last evaluation's value: recoverable, so patience 3 applies
    final = StopRule("max_attn_logit", "<=", 4.0, patience=3)
    late = run_trial(cfg, Recorder(), stop_rules=[final])
    assert late.status == "pruned" and late.steps_done == first_bad + 10


def test_patience_survives_a_relaunch(tmp_path: Path) -> None:
    """The run of violations is part of the checkpoint: a trial relaunched after its second
    violating evaluation (a crash, a hand-back) stops at the third, as if never interrupted.
    Before, the count started over at every resume, so a trial relaunched often enough was
    never stopped (here: two more evaluations past the one that should have stopped it)."""
    cfg = tiny(
        model={"qk_init_std": 1.5},
        steps=40,
        eval_every=5,
        checkpoint={"dir": str(tmp_path / "ckpt"), "every_evals": 1},
    )
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_trial(cfg, Recorder(crash_at_step=15), stop_rules=[FINAL])  # after 2 violations
    resumed = Recorder()
    out = run_trial(cfg, resumed, stop_rules=[FINAL])
    assert resumed.steps == [15]  # resumed from the checkpoint at step 10
    assert out.status == "pruned" and out.steps_done == 15
    assert out.stop_reason is not None and "(3 evaluations in a row)" in out.stop_reason


def test_a_checkpoint_without_a_count_or_with_other_rules_starts_the_count_afresh() -> None:
    stopper = Stopper([FINAL])
    stopper.check(5, SimpleNamespace(min_norm_entropy=0.05))
    state = stopper.state()
    other = Stopper([StopRule("min_norm_entropy", ">=", 0.2, patience=3)])
    other.restore(state)  # another bound: not this rule's count
    assert other.state()[0][1] == 0
    same = Stopper([FINAL])
    same.restore(state)
    assert same.state() == state
    same.restore(None)  # a checkpoint from before the count was saved
    assert same.state()[0][1] == 0
