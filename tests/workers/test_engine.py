"""The trial engine's slots (workers/engine.py): members join and leave a fused runner mid-run
and still equal their run-alone twins; a stopped member is stopped for good (its stop record
is honoured by every later execution); a checkpoint directory proves whose it is; a stopped
member costs no more compute; a lambda-0 member trains exactly as with no regularizer, even
where its own penalty would overflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workers.helpers import MEMBERS, Recorder, assert_same_evaluations, quickstart, tiny
from workers.checkpoints import OWNER_FILE, STOPPED_FILE
from workers.config import TrialConfig
from workers.engine import (
    Engine,
    Member,
    PlainRunner,
    autocast_for,
    new_member,
    resolve_device,
)
from workers.fused import FusedRunner, run_trial_group
from workers.metrics import qk_sym_moments
from workers.trial import run_trial


def _engine(slots: int, finished: list[Member] | None = None) -> Engine:
    cfg = TrialConfig()
    device = torch.device("cpu")
    ctx = autocast_for(cfg, device)
    done = finished if finished is not None else []
    return Engine(FusedRunner(slots, device, ctx), device, ctx, on_finish=done.append)


def test_a_member_that_joins_mid_run_equals_the_trial_run_alone() -> None:
    """Member 1 joins after member 0 trained 30 steps; member 2 takes member 0's slot the
    moment it stops. Each equals its run-alone twin (the fused contract, 1e-4 in float32)."""
    configs = [quickstart(**m, steps=60, eval_every=20) for m in MEMBERS[:3]]
    alone = [Recorder() for _ in configs]
    for c, r in zip(configs, alone, strict=True):
        run_trial(c, r)
    finished: list[Member] = []
    engine = _engine(2, finished)
    recs = [Recorder() for _ in configs]
    mems = [
        new_member(c, r, torch.device("cpu"), tag=i)
        for i, (c, r) in enumerate(zip(configs, recs, strict=True))
    ]
    engine.admit(mems[0])
    for _ in range(30):
        engine.iterate()
    engine.admit(mems[1])
    while mems[0].summary is None:
        engine.iterate()
    assert mems[1].step == 30  # its own schedule: 30 steps behind member 0
    engine.admit(mems[2])
    engine.run()
    assert [m.tag for m in finished] == [0, 1, 2]
    for a, f in zip(alone, recs, strict=True):
        assert_same_evaluations(a, f)
    assert engine.steps_run == 3 * 60


def test_members_resume_in_other_slots_from_their_own_checkpoints(tmp_path: Path) -> None:
    def cfgs() -> list[TrialConfig]:
        return [
            tiny(seed=s, checkpoint={"dir": str(tmp_path / f"m{s}")}, optim={"lr": 3e-3 * (s + 1)})
            for s in range(2)
        ]

    alone = [Recorder(), Recorder()]
    for c, r, s in zip(cfgs(), alone, range(2), strict=True):
        run_trial(
            c.model_copy(
                update={
                    "checkpoint": c.checkpoint.model_copy(update={"dir": str(tmp_path / f"a{s}")})
                }
            ),
            r,
        )
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_trial_group(cfgs(), [Recorder(), Recorder(crash_at_step=15)])
    # resumed in the other order: member 1 in slot 0, member 0 in slot 1
    c0, c1 = cfgs()
    r0, r1 = Recorder(), Recorder()
    out = run_trial_group([c1, c0], [r1, r0])
    assert r0.steps == [20] and r1.steps == [15, 20]
    for a, r in ((alone[0], r0), (alone[1], r1)):
        for step in r.steps:
            for name in ("val_loss", "train_loss"):
                key = (name, None, None)
                assert abs(a.at(step)[key] - r.at(step)[key]) <= 1e-4 * abs(a.at(step)[key])
    assert [s.steps_done for s in out] == [20, 20]


@pytest.mark.parametrize("how", ["pruned", "diverged"])
def test_a_stopped_trial_never_trains_again(tmp_path: Path, how: str) -> None:
    """The stop is recorded before anything else trains; a rerun (a Ray retry, a runner
    restart) returns the recorded summary and reports nothing, alone or as a member."""
    if how == "pruned":
        cfg, rec = tiny(checkpoint={"dir": str(tmp_path)}), Recorder(stop_at_report=2)
    else:  # SGD at a huge learning rate, no clipping: the loss overflows within a few steps
        cfg = tiny(
            checkpoint={"dir": str(tmp_path)},
            optim={"name": "sgd", "lr": 10.0, "grad_clip": None, "schedule": "constant"},
            steps=200,
            eval_every=2,
        )
        rec = Recorder()
    first = run_trial(cfg, rec)
    assert first.status == how
    record = json.loads((tmp_path / STOPPED_FILE).read_text())
    assert record["status"] == how and record["step"] == first.steps_done < cfg.steps
    for rerun in (lambda r: run_trial(cfg, r), lambda r: run_trial_group([cfg], [r])[0]):
        again = Recorder()
        summary = rerun(again)
        assert again.reports == []  # not one step trained, nothing reported
        assert summary.status == how and summary.steps_done == first.steps_done
        assert summary.eval_steps == first.eval_steps


def test_a_checkpoint_directory_of_another_owner_is_not_resumed(tmp_path: Path) -> None:
    """Study 1 / trial 0 of a reset database must not resume the old run's weights."""
    old = tiny(checkpoint={"dir": str(tmp_path), "owner": "study-1@old/trial-0"})
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_trial(old, Recorder(crash_at_step=15))
    assert (tmp_path / "checkpoint.pt").exists()
    new = tiny(checkpoint={"dir": str(tmp_path), "owner": "study-1@new/trial-0"})
    rec = Recorder()
    run_trial(new, rec)
    assert rec.steps == [5, 10, 15, 20]  # from step 0: nothing of the old run was used
    assert (tmp_path / OWNER_FILE).read_text() == "study-1@new/trial-0"
    # the same owner resumes as before
    rec_same = Recorder()
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_trial(
            tiny(checkpoint={"dir": str(tmp_path / "b"), "owner": "x"}), Recorder(crash_at_step=15)
        )
    run_trial(tiny(checkpoint={"dir": str(tmp_path / "b"), "owner": "x"}), rec_same)
    assert rec_same.steps == [15, 20]


def test_a_pruned_member_costs_no_more_compute() -> None:
    configs = [tiny(seed=s, steps=40, eval_every=10) for s in range(3)]
    finished: list[Member] = []
    engine = _engine(3, finished)
    recs = [Recorder(stop_at_report=1), Recorder(), Recorder(stop_at_report=2)]
    for i, (c, r) in enumerate(zip(configs, recs, strict=True)):
        engine.admit(new_member(c, r, torch.device("cpu"), tag=i))
    engine.run()
    assert [m.tag for m in finished] == [0, 2, 1]  # each finished the moment it stopped
    assert [m.summary.steps_done for m in sorted(finished, key=lambda m: m.tag)] == [10, 40, 20]  # type: ignore[union-attr]
    assert engine.steps_run == 10 + 40 + 20


def test_a_lambda_zero_member_trains_as_with_no_regularizer_in_the_fused_path() -> None:
    """kind locater at lambda 0 beside a regularized member == kind none beside the same."""
    partner = tiny(seed=1, regularizer={"kind": "spectral_variance", "lambda": 0.5})
    zero = tiny(seed=0, regularizer={"kind": "locater", "lambda": 0.0, "target_mean": 1.0})
    none = tiny(seed=0, regularizer={"kind": "none"})
    a, b = Recorder(), Recorder()
    run_trial_group([zero, partner], [a, None])
    run_trial_group([none, partner], [b, None])
    assert a.stream() == b.stream()  # bit for bit


def _overflowing_pair(first: TrialConfig, partner: TrialConfig) -> FusedRunner:
    """`first` and `partner` placed in one fused runner, `first`'s W_Q, W_K scaled by 3e10.

    With QK-LayerNorm the forward pass is scale-invariant in W_Q, W_K (its loss and gradient
    stay finite and small), while ||W_sym||_F^2, (3e10)^4 times its value at init, overflows float32 to inf.
    """
    cpu = torch.device("cpu")
    mems = [new_member(c, None, cpu) for c in (first, partner)]
    with torch.no_grad():
        for name, p in mems[0].model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3e10)
    runner = FusedRunner(2, cpu, autocast_for(first, cpu))
    runner.place(mems)
    return runner


def test_a_lambda_zero_member_is_untouched_by_its_own_overflowing_penalty() -> None:
    """METRICS.md section 4: lambda 0 trains exactly as no regularizer, with no `0 * penalty`
    term that an overflowing penalty turns into NaN. Here the lambda-0 member's own penalty is
    inf (float32 overflow), so `loss + 0 * penalty` is NaN (checked on the same fused
    model, so the test fails if the runner ever adds that term); the runner's step gives it a
    finite loss and gradient, bit for bit those of its no-regularizer twin beside the same
    lambda > 0 partner."""
    model = {"qk_norm": "layernorm"}
    partner = tiny(seed=1, model=model, regularizer={"kind": "spectral_variance", "lambda": 0.5})
    zero = tiny(
        seed=0, model=model, regularizer={"kind": "locater", "lambda": 0.0, "target_mean": 1.0}
    )
    none = tiny(seed=0, model=model, regularizer={"kind": "none"})

    # The naive formula, on the very fused model the runner steps: a NaN loss (which the
    # runner would flag as a divergence).
    naive = _overflowing_pair(zero, partner)
    assert naive.fused is not None
    w_q, w_k = naive.fused.qk_weights()
    _, sym_sq = qk_sym_moments(w_q[0].float(), w_k[0].float())
    assert torch.isinf(sym_sq).any()  # ||W_sym||_F^2 / D overflows float32
    pen = naive.fused.penalties(["locater", "spectral_variance"], [1.0, 0.0])
    assert not torch.isfinite(pen[0]) and torch.isfinite(pen[1])
    batches = [m.task.train_batch(m.config.batch_size, m.data_gen) for m in naive.members]
    x, y = torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches])
    loss, _ = naive.forward(x, y, None)  # no member with z-loss
    assert torch.isfinite(loss).all()  # the loss itself is fine: only the penalty overflows
    lams = torch.tensor([0.0, 0.5])
    total = loss + lams * pen  # `loss + 0 * penalty` for member 0
    assert torch.isnan(total[0]) and torch.isfinite(total[1])

    # The runner's step: member 0 finite and equal to its no-regularizer twin, bit for bit.
    outs, params = [], []
    for first in (zero, none):
        runner = _overflowing_pair(first, partner)
        assert runner.fused is not None
        batches = [m.task.train_batch(m.config.batch_size, m.data_gen) for m in runner.members]
        outs.append(runner.train_step(batches, torch.ones(2, dtype=torch.bool)))
        params.append([p.detach().clone() for p in runner.fused.parameters()])
    got, twin = outs
    assert not got.bad[0] and torch.isfinite(got.loss[0]) and torch.isfinite(got.grad_norm[0])
    assert got.penalty is not None and got.penalty[0] == 0.0  # none computed for member 0
    assert torch.equal(got.loss, twin.loss) and torch.equal(got.grad_norm, twin.grad_norm)
    assert torch.equal(got.bad, twin.bad)
    assert all(torch.isfinite(p).all() for p in params[0])
    assert all(torch.equal(a, b) for a, b in zip(*params, strict=True))


def test_engine_needs_a_free_slot() -> None:
    engine = _engine(1)
    device = resolve_device(tiny())
    engine.admit(new_member(tiny(), None, device))
    with pytest.raises(RuntimeError, match="no free slot"):
        engine.admit(new_member(tiny(seed=1), None, device))


class _BreakStorageAt(Recorder):
    """A reporter that makes its member's checkpoint unwritable at one step (a directory
    where `checkpoint.tmp` goes: every write there fails with an OSError, as a full disk or
    a lost mount would), after it recorded the report."""

    def __init__(self, directory: Path, step: int) -> None:
        super().__init__()
        self.directory, self.break_at = directory, step

    def report(self, step: int, metrics: list[Any], value: float | None) -> str | None:
        stop = super().report(step, metrics, value)
        if step == self.break_at:
            (self.directory / "checkpoint.tmp").mkdir(parents=True)
        return stop


def test_a_members_failing_storage_fails_it_alone_and_the_others_train_on(tmp_path: Path) -> None:
    """Issue 27: one member's checkpoint that cannot be written took its healthy co-members
    down with it (the error ended the whole worker)."""
    cfgs = [tiny(seed=s, checkpoint={"dir": str(tmp_path / f"m{s}")}) for s in range(2)]
    failed: list[tuple[int, str]] = []
    finished: list[Member] = []
    device = resolve_device(cfgs[0])
    ctx = autocast_for(cfgs[0], device)
    engine = Engine(
        FusedRunner(2, device, ctx),
        device,
        ctx,
        on_finish=finished.append,
        on_error=lambda mem, e: failed.append((mem.tag, type(e).__name__)),
    )
    broken = _BreakStorageAt(tmp_path / "m0", step=10)
    healthy = Recorder()
    engine.admit(new_member(cfgs[0], broken, device, tag=0))
    engine.admit(new_member(cfgs[1], healthy, device, tag=1))
    engine.run()
    assert failed == [(0, "IsADirectoryError")]
    assert [m.tag for m in finished] == [1] and finished[0].summary is not None
    assert finished[0].summary.status == "completed" and healthy.steps == [5, 10, 15, 20]
    assert broken.steps == [5, 10]  # it left at the evaluation whose checkpoint failed
    assert not (tmp_path / "m0" / STOPPED_FILE).exists()  # a failure, not a stop
    alone = tiny(checkpoint={"dir": str(tmp_path / "alone")})
    with pytest.raises(IsADirectoryError):  # without on_error (run_trial) it propagates
        run_trial(alone, _BreakStorageAt(tmp_path / "alone", 5))


_FULL_DISK = """
import json, resource, signal, sys
from tests.workers.helpers import Recorder, tiny
from workers.engine import Engine, autocast_for, new_member, resolve_device
from workers.fused import FusedRunner

cfgs = [tiny(seed=0, checkpoint={"dir": sys.argv[1]}), tiny(seed=1)]  # only m0 writes files
device = resolve_device(cfgs[0])
ctx = autocast_for(cfgs[0], device)
failed, finished = [], []
engine = Engine(FusedRunner(2, device, ctx), device, ctx, on_finish=finished.append,
                on_error=lambda mem, e: failed.append([mem.tag, type(e).__name__, str(e)]))
for i, c in enumerate(cfgs):
    engine.admit(new_member(c, Recorder(), device, tag=i))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
engine.run()
print(json.dumps({"failed": failed, "finished": [[m.tag, m.summary.status] for m in finished]}))
"""


def test_a_checkpoint_that_hits_a_full_disk_fails_its_member_alone(tmp_path: Path) -> None:
    """A real short write, in a process of its own with a file-size limit: torch's writer
    reports it as a RuntimeError, not an OSError, and before the fix that error ended the
    whole worker instead of its member."""
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path / "m0")],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert [f[:2] for f in got["failed"]] == [[0, "OSError"]], got
    assert "checkpoint write" in got["failed"][0][2]
    assert got["finished"] == [[1, "completed"]]
    assert not (tmp_path / "m0" / "checkpoint.tmp").exists()  # no stray file left behind


class _HearsStop(Recorder):
    """A reporter whose owner's verdict on its report at step `judged` arrives `late` steps
    later, through `poll()` (between evaluations), as the inbox's verdict does."""

    def __init__(self, judged: int, late: int) -> None:
        super().__init__()
        self.judged, self.late, self.polls_after = judged, late, 0

    def poll(self) -> str | None:
        if self.judged in self.steps:
            self.polls_after += 1
        if self.polls_after >= self.late:
            return f"median pruner: final_val_loss 1 at step {self.judged}"
        return None


def _without_clock(s: Any) -> dict[str, Any]:
    d = s.model_dump()
    for k in ("wall_time_s", "tokens_per_s", "stop_reason"):
        d.pop(k)
    return dict(d)


def test_a_stop_heard_between_evaluations_stops_the_member_as_of_its_judged_evaluation() -> None:
    """The runner's verdict on the step-10 report arrives 3 steps later: the member stops then,
    PRUNED as of step 10, with the summary of the same trial stopped by its step-10 report
    (computed independently, by the report's own answer); 13 steps were trained, not 15."""
    cfg = tiny(steps=20, eval_every=5)
    device = resolve_device(cfg)
    stopped_by_report = run_trial(cfg, Recorder(stop_at_report=2), objective="final_val_loss")
    assert stopped_by_report.status == "pruned" and stopped_by_report.steps_done == 10
    finished: list[Member] = []
    ctx = autocast_for(cfg, device)
    engine = Engine(PlainRunner(ctx), device, ctx, on_finish=finished.append)
    hears = _HearsStop(judged=10, late=3)
    engine.admit(new_member(cfg, hears, device, objective="final_val_loss"))
    engine.run()
    (mem,) = finished
    assert mem.summary is not None and mem.summary.status == "pruned"
    assert mem.summary.stop_reason == "median pruner: final_val_loss 1 at step 10"
    assert mem.summary.steps_done == 10 and hears.steps == [5, 10]
    assert _without_clock(mem.summary) == _without_clock(stopped_by_report)
    assert engine.steps_run == 13


def test_a_member_without_a_pruned_objective_is_never_polled() -> None:
    """No objective, no pruner: nothing to hear between evaluations (and no poll per step)."""
    cfg = tiny(steps=20, eval_every=5)
    hears = _HearsStop(judged=5, late=1)
    summary = run_trial(cfg, hears)
    assert summary.status == "completed" and summary.steps_done == 20
    assert hears.polls_after == 0


def test_a_fused_member_that_hears_a_stop_leaves_and_its_mate_trains_on_unchanged() -> None:
    """Two fused members: member 0 hears its step-10 verdict 2 steps late and leaves; member 1
    equals its run-alone twin to the end (the fused contract)."""
    configs = [quickstart(**m, steps=40, eval_every=10) for m in MEMBERS[:2]]
    alone = Recorder()
    run_trial(configs[1], alone)
    finished: list[Member] = []
    engine = _engine(2, finished)
    hears, mate = _HearsStop(judged=10, late=2), Recorder()
    device = torch.device("cpu")
    engine.admit(new_member(configs[0], hears, device, tag=0, objective="final_val_loss"))
    engine.admit(new_member(configs[1], mate, device, tag=1))
    engine.run()
    assert [m.tag for m in finished] == [0, 1]
    first = finished[0].summary
    assert first is not None and first.status == "pruned" and first.steps_done == 10
    assert hears.steps == [10]
    assert_same_evaluations(alone, mate)
    assert engine.steps_run == 12 + 40
