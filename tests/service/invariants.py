"""What must hold for a finished study whatever happened to it on the way (node loss, a
killed runner job, an API or Ray restart): every planned trial accounted for once, Optuna
and qkscope agreeing, and every completed trial's metric rows all there, exactly once."""

from __future__ import annotations

from typing import Any

import optuna
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from service.store.models import CURRENT_PENALTY_VERSION, Metric, Study, Trial
from service.store.session import make_engine, make_sessionmaker, normalize_url

ATTN = (
    "attn_entropy",
    "attn_entropy_norm",
    "attn_top1_mass",
    "qk_eig_mean",
    "qk_eig_var",
    "qk_eig_mean_rank",
    "attn_logit_max",
)


def expected_metric_keys(
    spec: dict[str, Any], params: dict[str, Any]
) -> set[tuple[str, int, int, int]]:
    """(name, layer, head, step) of every row a completed trial reports, from its config alone."""
    base = spec["base"]
    model = base["model"]
    n_layers, n_heads = model["n_layers"], model["n_heads"]
    steps, every = base["steps"], base["eval_every"]
    eval_steps = set(range(every, steps + 1, every)) | {steps}
    reg = base.get("regularizer", {})
    lam = params.get("regularizer.lambda", reg.get("lambda", 0.0))
    scalars = ["train_loss", "val_loss", "grad_norm", "lr", "output_log_z"]
    if reg.get("kind", "none") != "none" and lam != 0:
        scalars.append("reg_penalty")
    # the attention mass on the answer's key: tasks that know which key a query needs
    target = ("attn_target_mass",) if base["task"]["kind"] == "associative_recall" else ()
    # Pre-LN (the default): the effective form diag(g) W diag(g) (docs/metrics.md section 3)
    if model.get("norm", "pre") == "pre":
        target += ("qk_eff_eig_mean", "qk_eff_eig_var")
    keys: set[tuple[str, int, int, int]] = set()
    for step in eval_steps:
        keys |= {(n, -1, -1, step) for n in scalars}
        keys |= {
            (n, layer, head, step)
            for n in ATTN + target
            for layer in range(1, n_layers + 1)
            for head in range(n_heads)
        }
        keys |= {("rank_ratio", layer, -1, step) for layer in range(n_layers + 1)}
    return keys


def check_finished_study(db_url: str, study_id: int) -> list[Trial]:
    """Assert the invariants of a finished study; returns its trials ordered by number."""
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            study = s.get(Study, study_id)
            assert study is not None
            assert study.status == "COMPLETED", study.error
            spec = study.spec
            trials = list(
                s.scalars(select(Trial).where(Trial.study_id == study_id).order_by(Trial.number))
            )
            n = spec["budget"]["n_trials"]
            assert [t.number for t in trials] == list(range(n)), "each planned trial exactly once"
            for t in trials:
                assert t.state in ("COMPLETE", "PRUNED", "FAILED", "DIVERGED"), (t.number, t.state)
                # every trial says which penalty definitions trained it (docs/metrics.md 4)
                assert t.penalty_version == CURRENT_PENALTY_VERSION, (t.number, t.penalty_version)
                if t.state == "FAILED":
                    assert t.error, f"trial {t.number} failed without a reason"
                else:
                    assert t.finished_at is not None and t.summary is not None
            _check_metric_rows(s, spec, trials)
        _check_optuna_agrees(db_url, study_id, trials)
        return trials
    finally:
        engine.dispose()


def _check_metric_rows(s: Session, spec: dict[str, Any], trials: list[Trial]) -> None:
    ids = [t.id for t in trials]
    dupes = s.execute(
        text(
            "SELECT trial_id, name, layer, head, step, count(*) FROM qk_metric "
            "WHERE trial_id IN (" + ",".join(map(str, ids)) + ") "
            "GROUP BY trial_id, name, layer, head, step HAVING count(*) > 1"
        )
    ).all()
    assert dupes == [], f"duplicated metric rows: {dupes[:5]}"
    for t in trials:
        got = {
            tuple(r)
            for r in s.execute(
                select(Metric.name, Metric.layer, Metric.head, Metric.step).where(
                    Metric.trial_id == t.id
                )
            )
        }
        count = s.scalar(select(func.count()).where(Metric.trial_id == t.id))
        assert t.metric_rows == count, (t.number, t.metric_rows, count)
        if t.state != "FAILED" and got:  # nothing trained (or reported) past where it stopped
            stopped_at = int((t.summary or {})["steps_done"])
            assert max(k[3] for k in got) <= stopped_at, (t.number, t.state, stopped_at)
            assert t.last_step == stopped_at, (t.number, t.last_step, stopped_at)
        if t.state == "COMPLETE":
            want = expected_metric_keys(spec, t.params)
            assert got == want, (
                f"trial {t.number}: missing {sorted(want - got)[:5]}, extra {sorted(got - want)[:5]}"
            )
            values = s.scalars(
                select(Metric.value).where(Metric.trial_id == t.id, Metric.name == "val_loss")
            ).all()
            assert all(v is not None for v in values)


def _check_optuna_agrees(db_url: str, study_id: int, trials: list[Trial]) -> None:
    storage = optuna.storages.RDBStorage(normalize_url(db_url))
    try:
        study = optuna.load_study(study_name=f"qkscope-{study_id}", storage=storage)
        states = {ft.number: ft.state.name for ft in study.get_trials(deepcopy=False)}
    finally:
        storage.engine.dispose()
    ours = {"COMPLETE": "COMPLETE", "PRUNED": "PRUNED", "FAILED": "FAIL", "DIVERGED": "COMPLETE"}
    assert states == {t.number: ours[t.state] for t in trials}


# Steps for tests that interrupt a trial seen RUNNING past step 40 and then assert it was
# retried: about 4 s of training alone on one core, so the trial is still training when the
# fault lands. The stored step lags the trial's own by up to a report batch; at the default
# 160 steps a trial could finish inside that lag (a CI flake: attempts stayed 1).
INTERRUPT_STEPS = 480


def fault_spec(n_trials: int, max_retries: int = 2, steps: int = 160) -> dict[str, Any]:
    """A small study whose trials take a few seconds and checkpoint at every evaluation."""
    return {
        "name": "fault-tolerance",
        "base": {
            "task": {
                "kind": "associative_recall",
                "seq_len": 24,
                "n_symbols": 16,
                "n_pairs": 6,
                "n_valid": 64,
            },
            "model": {"n_layers": 2, "n_heads": 2, "d_model": 32, "d_ff": 64, "norm": "pre"},
            "regularizer": {"kind": "locater", "lambda": 0.01},
            "optim": {"lr": 0.003},
            "batch_size": 32,
            "steps": steps,
            "eval_every": 20,
            "eval_batches": 1,
            "seed": 0,
        },
        "search_space": {"model.qk_init_std": {"type": "float", "low": 0.02, "high": 0.5}},
        "sampler": {"kind": "random", "seed": 1},
        "budget": {"n_trials": n_trials},
        "parallelism": 2,
        "max_retries": max_retries,
        "objectives": [{"metric": "final_val_loss", "direction": "minimize"}],
        "resources": {"cpus": 1, "gpus": 0},
        # one-slot workers (the plain runner): these tests are about retries and restarts of
        # that path (fused slot workers' faults: test_slots.py, test_fused_study.py, ...)
        "fuse": 1,
    }
