"""The running maxima of the instability signals (docs/metrics.md section 9): a non-finite
value counts as +inf and is never skipped, and the maxima start at the step-0 evaluation
(`eval_at_init`). So an overflowing attention logit is the strongest violation of
`max_attn_logit_ever <= bound`: the trial stops at that evaluation with `inf` in its
summary, not the last finite value."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests.workers.helpers import Recorder, tiny
from workers import metrics as M
from workers.config import MetricPoint, TrialStatus
from workers.evaluation import History, intermediate_value, summarize
from workers.member import new_member
from workers.stopping import StopRule
from workers.tasks import build_task
from workers.trial import run_trial

BOUND = 50.0
OVERFLOW_STEP = 15  # the evaluation whose attention logits overflow (steps 0, 5, 10, 15, 20)
N_LAYERS = 2  # tiny()'s: attention_logit_max runs once per layer per evaluation


def _overflow_from(evaluation: int) -> Callable[..., torch.Tensor]:
    """`attention_logit_max` as it is, except that from the `evaluation`-th evaluation on (0:
    step 0) layer 1's q and k enter it scaled by 1e30: <q, k> ~ 1e60 overflows float32 to
    inf inside the metric's own arithmetic, while the model (and so its loss) is untouched."""
    real = M.attention_logit_max
    calls = [0]

    def hooked(q: torch.Tensor, k: torch.Tensor, **kw: Any) -> torch.Tensor:
        n = calls[0]
        calls[0] += 1
        if n // N_LAYERS >= evaluation and n % N_LAYERS == 0:
            q, k = q * 1e30, k * 1e30
        return real(q, k, **kw)

    return hooked


def _cfg() -> Any:
    return tiny(steps=20, eval_every=5, eval_at_init=True)


def _largest(rec: Recorder, step: int, name: str = "attn_logit_max") -> float:
    return max(v for (n, _, _), v in rec.at(step).items() if n == name)


def test_an_overflowing_attention_logit_stops_the_trial_at_that_evaluation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`max_attn_logit_ever <= 50`: the logits stay far below 50 until the evaluation at
    step 15, where one overflows (the loss still finite); the trial stops there, pruned, its
    summary's maximum inf and its reason saying so. Before, the overflow was skipped: the
    maximum kept the last finite value and the trial ran to its end."""
    cfg = _cfg()
    monkeypatch.setattr(M, "attention_logit_max", _overflow_from(OVERFLOW_STEP // 5))
    rec = Recorder()
    rule = StopRule("max_attn_logit_ever", "<=", BOUND, patience=1)
    out = run_trial(cfg, rec, stop_rules=[rule], objective="max_attn_logit_ever")
    assert rec.steps == [0, 5, 10, OVERFLOW_STEP]
    assert all(_largest(rec, s) < 1.0 for s in (0, 5, 10))  # premise: far below the bound
    assert _largest(rec, OVERFLOW_STEP) == math.inf  # the metric itself overflowed
    assert math.isfinite(rec.at(OVERFLOW_STEP)[("val_loss", None, None)])  # not a divergence
    assert out.status == TrialStatus.PRUNED and out.steps_done == OVERFLOW_STEP
    assert out.stop_reason == f"max_attn_logit_ever inf > 50 at step {OVERFLOW_STEP}"
    assert out.max_attn_logit_ever == math.inf
    # the pruned objective's intermediate value: the overflow, told as it is (not dropped)
    assert rec.values[OVERFLOW_STEP] == math.inf
    assert rec.values[10] == max(_largest(rec, s) for s in (0, 5, 10))
    # the stored form (the trial's end record is JSON): inf, not null
    assert out.model_dump(mode="json")["max_attn_logit_ever"] == math.inf


def test_without_a_bound_an_overflow_stays_the_maximum_to_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only step 10 overflows; later evaluations are finite again: the running maximum
    stays inf (never the last finite value)."""
    real = M.attention_logit_max
    calls = [0]

    def at_step_10_only(q: torch.Tensor, k: torch.Tensor, **kw: Any) -> torch.Tensor:
        n = calls[0]
        calls[0] += 1
        if n // N_LAYERS == 2:
            q = q * 1e30
            k = k * 1e30
        return real(q, k, **kw)

    monkeypatch.setattr(M, "attention_logit_max", at_step_10_only)
    rec = Recorder()
    out = run_trial(_cfg(), rec)
    assert out.status == TrialStatus.COMPLETED and out.steps_done == 20
    assert _largest(rec, 10) == math.inf and math.isfinite(_largest(rec, 20))
    assert out.max_attn_logit_ever == math.inf
    assert out.max_attn_logit is not None and math.isfinite(out.max_attn_logit)


def _logit_max_float64(cfg: Any) -> float:
    """The untrained model's largest |attention logit| on the trial's probe batch, from its
    q and k in float64 numpy (causal keys only): independent of attention_logit_max."""
    mem = new_member(cfg, None, torch.device("cpu"))
    assert build_task(cfg.task, cfg.seed).seq_len == mem.probe_x.shape[1]
    mem.model.eval()
    with torch.no_grad():
        out = mem.model.probe(mem.probe_x)
    best = 0.0
    for layer, (q, k) in enumerate(out.qk):
        qn, kn = q.double().numpy(), k.double().numpy()
        z = np.einsum("bhtd,bhsd->bhts", qn, kn) * out.layer_scale(layer)
        t, s = z.shape[-2:]
        allowed = np.tril(np.ones((t, s), dtype=bool), k=s - t)
        best = max(best, float(np.abs(z[..., allowed]).max()))
    return best


def test_the_running_maximum_starts_at_step_0() -> None:
    """qk_init_std 1.5 with strong independent weight decay: the untrained model's logits
    (~240) are the largest the trial ever has (~44 at step 5, falling). The summary's maximum
    is the step-0 value, as an independent float64 computation on the untrained model has it;
    before, step 0 was left out and the maximum was step 5's."""
    cfg = tiny(
        model={"qk_init_std": 1.5},
        steps=20,
        eval_every=5,
        eval_at_init=True,
        optim={"lr": 0.01, "schedule": "constant", "weight_decay": 0.1,
               "weight_decay_mode": "independent"},
    )  # fmt: skip
    rec = Recorder()
    out = run_trial(cfg, rec)
    at_init = _largest(rec, 0)
    later = [_largest(rec, s) for s in (5, 10, 15, 20)]
    assert at_init > 2 * max(later)  # premise: step 0 is the largest
    assert out.max_attn_logit_ever == at_init
    assert at_init == pytest.approx(_logit_max_float64(cfg), rel=1e-5)
    # the same holds for |output_log_z|: its maximum is over step 0 and every evaluation
    log_zs = [abs(rec.at(s)[("output_log_z", None, None)]) for s in (0, 5, 10, 15, 20)]
    assert out.max_abs_output_log_z_ever == max(log_zs)


def test_a_step_0_violation_stops_the_trial_at_step_0() -> None:
    """The maxima start at step 0, so an untrained model over the bound can never meet it:
    the rule stops the trial there, untrained."""
    cfg = tiny(model={"qk_init_std": 1.5}, steps=20, eval_every=5, eval_at_init=True)
    rec = Recorder()
    out = run_trial(cfg, rec, stop_rules=[StopRule("max_attn_logit_ever", "<=", 100.0, 1)])
    assert rec.steps == [0] and out.status == TrialStatus.PRUNED and out.steps_done == 0
    assert out.stop_reason is not None and out.stop_reason.endswith("> 100 at step 0")
    assert out.max_attn_logit_ever == _largest(rec, 0) > 100.0


def _points(logits: list[float], log_z: float | None) -> list[MetricPoint]:
    pts = [MetricPoint("attn_logit_max", v, 1, h) for h, v in enumerate(logits)]
    return pts + ([] if log_z is None else [MetricPoint("output_log_z", log_z)])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_any_non_finite_value_counts_as_plus_inf_and_nothing_measured_is_no_value(
    bad: float,
) -> None:
    """NaN and -inf count as +inf as well (an overflow may show as either); an evaluation
    that measured nothing adds no value; a checkpoint from before (NaN entries, no step 0)
    still summarises."""
    hist = History.empty()
    for step, pts in [(5, _points([1.0, 2.0], -3.0)), (10, _points([bad, 0.5], bad)),
                      (15, _points([], None))]:  # fmt: skip
        hist.steps.append(step)
        hist.val_losses.append(1.0)
        hist.train_losses.append(1.0)
        hist.min_norm_entropies.append(0.5)
        hist.last_points = pts
        hist.record_signals(pts)
    s = _summary(hist)
    assert s.max_attn_logit_ever == math.inf and s.max_abs_output_log_z_ever == math.inf
    assert intermediate_value(s, "max_attn_logit_ever") == math.inf
    empty = History([5], [1.0], [1.0], [0.5], [], max_attn_logits=[math.nan],
                    abs_output_log_zs=[math.nan])  # fmt: skip
    assert _summary(empty).max_attn_logit_ever is None  # not measured: still no value
    old = History([5], [1.0], [1.0], [0.5], [])  # a checkpoint from before the fields
    assert _summary(old).max_attn_logit_ever is None


def _summary(hist: History) -> Any:
    cfg = _cfg()
    task = build_task(cfg.task, cfg.seed)
    return summarize(cfg, task, hist, TrialStatus.COMPLETED, 20, None, 1.0, torch.device("cpu"))
