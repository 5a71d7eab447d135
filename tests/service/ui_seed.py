"""Studies for the web UI's browser tests: a finished quickstart-like study and a running one,
written the way the runner writes them (the study through `create_study`, trial rows with
their summary columns, metric rows through `service.store.ingest.insert_metrics`).

The finished study is study_defs/quickstart.yaml itself (2 layers x 2 heads, evaluated every
50 of 400 steps), with eight COMPLETE trials whose numbers follow a seeded pattern; trial 0
has one head (layer 2, head 1) whose normalised entropy falls below the collapse threshold
from step 200 on, and a trapped final plateau.

A third, finished study has two objectives (final_val_loss down, min_norm_entropy up) and
PARETO_TRIALS COMPLETE trials without metric rows: more than one page of the trial table,
and a Pareto front to draw.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Engine, insert, select, update
from sqlalchemy.orm import Session

from service.spec import parse_spec
from service.store.ingest import insert_metrics
from service.store.models import Study, Trial, utcnow
from service.store.session import make_sessionmaker
from service.store.studies import StudyRows
from tests.conftest import ROOT

QUICKSTART = ROOT / "study_defs" / "quickstart.yaml"
LAYERS = (1, 2)  # attention layers (rank_ratio also has layer 0, the embeddings)
HEADS = (0, 1)
STEPS = tuple(range(50, 401, 50))
COLLAPSED = (0, 2, 1)  # (trial number, layer, head) whose entropy collapses
COLLAPSE_FROM = 200
PARETO_TRIALS = 60  # the trial table shows 50 a page
PARETO_OBJECTIVES = [
    {"metric": "final_val_loss", "direction": "minimize"},
    {"metric": "min_norm_entropy", "direction": "maximize"},
]


@dataclass
class Seeded:
    finished_id: int
    running_id: int
    trial_ids: dict[int, int]  # number -> id, finished study
    running_trial_ids: dict[int, int]
    pareto_id: int  # the two-objective study
    pareto_values: dict[int, tuple[float, float, bool]]  # number -> (loss, entropy, feasible)


def eval_rows(
    trial_id: int, number: int, steps: tuple[int, ...], rng: random.Random
) -> list[dict[str, Any]]:
    """The metric rows of one trial's evaluations at `steps` (every series of the registry
    the quickstart writes)."""
    rows: list[dict[str, Any]] = []
    for step in steps:
        t = step / STEPS[-1]
        val = 2.9 - 0.4 * t + 0.05 * rng.random()
        for name, v in (
            ("train_loss", val + 0.05 * rng.random()),
            ("val_loss", val),
            ("grad_norm", 1.0 + rng.random()),
            ("lr", 0.003 * (1 - t)),
            ("reg_penalty", 30 * math.exp(-3 * t) + 1),
            ("output_log_z", -0.5 - 2 * t),
        ):
            rows.append({"trial_id": trial_id, "name": name, "step": step, "value": v})
        for layer in (0, *LAYERS):
            rows.append(
                {"trial_id": trial_id, "name": "rank_ratio", "layer": layer, "step": step,
                 "value": 0.95 - 0.1 * layer * t + 0.02 * rng.random()}
            )  # fmt: skip
        for layer in LAYERS:
            for head in HEADS:
                collapsed = (number, layer, head) == COLLAPSED and step >= COLLAPSE_FROM
                ent = 0.02 + 0.01 * rng.random() if collapsed else 0.4 + 0.5 * rng.random()
                # the collapsed head's logits grow (Wortsman et al.'s logit growth), the
                # others stay small
                logit = 60 * t if collapsed else 1.0 + 2 * layer * t + head + rng.random()
                for name, v in (
                    ("attn_entropy_norm", ent),
                    ("attn_entropy", ent * math.log(24)),
                    ("attn_logit_max", logit),
                    ("qk_eig_mean", 0.1 * head - 0.3 * (layer == 1) + 0.01 * t),
                    ("qk_eig_var", 30 * math.exp(-2 * t) + 5 * head),
                ):
                    rows.append(
                        {"trial_id": trial_id, "name": name, "layer": layer, "head": head,
                         "step": step, "value": v}
                    )  # fmt: skip
    return rows


def trial_row(study_id: int, number: int, state: str, rng: random.Random) -> dict[str, Any]:
    done = state == "COMPLETE"
    lam = math.exp(rng.uniform(math.log(1e-4), 0.0))
    std = math.exp(rng.uniform(math.log(0.02), math.log(1.5)))
    val = 2.3 + 0.5 * rng.random() if done else None
    collapsed = number == COLLAPSED[0]
    mne = (0.02 if collapsed else 0.3 + 0.6 * rng.random()) if done else None
    now = utcnow()
    summary = {
        "status": "completed",
        "steps_done": STEPS[-1],
        "final_val_loss": val,
        "min_norm_entropy": mne,
        "final_rank_ratio": 0.75 if done else None,
        "eval_steps": list(STEPS),
        "plateaus": [[250, 400]] if collapsed else [],
        "trapped": collapsed,
    } if done else None  # fmt: skip
    return {
        "study_id": study_id,
        "number": number,
        "state": state,
        "params": {"regularizer.lambda": lam, "model.qk_init_std": std},
        "seed": number,
        "node": "node-a",
        "value": val,
        "values": [val] if done else None,
        "feasible": (mne is not None and mne >= 0.1) if done else None,
        "summary": summary,
        "last_step": STEPS[-1] if done else 100,
        "final_val_loss": val,
        "min_norm_entropy": mne,
        "final_rank_ratio": 0.75 if done else None,
        "qk_eig_var": 10 * rng.random() if done else None,
        "plateau_steps": 0 if done else None,
        "entropy_collapse": (mne is not None and mne < 0.1) if done else None,
        "rank_collapse": False if done else None,
        "trapped": collapsed if done else None,
        "started_at": now - timedelta(seconds=30),
        "finished_at": now if done else None,
        "duration_s": 20 + number if done else None,
    }


def add_trial(
    engine: Engine, study_id: int, number: int, state: str, steps: tuple[int, ...]
) -> int:
    """One trial row and its metric rows (the ingest path); its id."""
    rng = random.Random(number)
    with Session(engine) as s:
        trial = Trial(**trial_row(study_id, number, state, rng))
        s.add(trial)
        s.commit()
        tid = int(trial.id)
    add_metrics(engine, tid, number, steps)
    return tid


def add_metrics(engine: Engine, trial_id: int, number: int, steps: tuple[int, ...]) -> None:
    with Session(engine) as s:
        insert_metrics(s, eval_rows(trial_id, number, steps, random.Random(trial_id)))
        if steps:
            s.execute(update(Trial).where(Trial.id == trial_id).values(last_step=max(steps)))
        s.commit()


def add_study(
    engine: Engine,
    name: str,
    status: str = "PENDING",
    objectives: list[dict[str, str]] | None = None,
    n_trials: int | None = None,
) -> int:
    """A study of the quickstart's definition (renamed; other objectives and budget if
    given); its id."""
    raw = yaml.safe_load(QUICKSTART.read_text())
    raw["name"] = name
    if objectives is not None:
        raw["objectives"] = objectives
    if n_trials is not None:
        raw["budget"]["n_trials"] = n_trials
    study, _ = StudyRows(make_sessionmaker(engine)).create(
        parse_spec(json.dumps(raw).encode(), "json")
    )
    if status != "PENDING":
        set_study(engine, study.id, status=status)
    return int(study.id)


def set_study(engine: Engine, study_id: int, **values: Any) -> None:
    with Session(engine) as s:
        s.execute(update(Study).where(Study.id == study_id).values(**values))
        s.commit()


def add_bare_trials(
    engine: Engine, study_id: int, numbers: range, objectives: int = 1
) -> dict[int, tuple[float, float, bool]]:
    """COMPLETE trials without metric rows (one INSERT); number -> (loss, entropy, feasible)."""
    out: dict[int, tuple[float, float, bool]] = {}
    rows = []
    for n in numbers:
        row = trial_row(study_id, n, "COMPLETE", random.Random(1000 + n))
        if objectives == 2:
            row["values"] = [row["final_val_loss"], row["min_norm_entropy"]]
        rows.append(row)
        out[n] = (row["final_val_loss"], row["min_norm_entropy"], row["feasible"])
    with Session(engine) as s:
        s.execute(insert(Trial), rows)
        s.commit()
    return out


def seed(engine: Engine) -> Seeded:
    """The finished quickstart-like study and a running one (two RUNNING trials)."""
    sessions = make_sessionmaker(engine)
    spec = parse_spec(Path(QUICKSTART).read_bytes(), "application/yaml")
    finished, _ = StudyRows(sessions).create(spec)
    running, _ = StudyRows(sessions).create(spec.model_copy(update={"name": "quickstart-running"}))
    now = utcnow()
    with Session(engine) as s:
        s.execute(
            update(Study)
            .where(Study.id == finished.id)
            .values(status="COMPLETED", ray_job_id=f"qkscope-study-{finished.id}-a1-000000",
                    job_attempts=1, started_at=now - timedelta(minutes=3), finished_at=now)
        )  # fmt: skip
        s.execute(
            update(Study)
            .where(Study.id == running.id)
            .values(status="RUNNING", ray_job_id=f"qkscope-study-{running.id}-a1-111111",
                    job_attempts=1, started_at=now)
        )  # fmt: skip
        s.commit()
    ids = {n: add_trial(engine, finished.id, n, "COMPLETE", STEPS) for n in range(8)}
    run_ids = {n: add_trial(engine, running.id, n, "RUNNING", STEPS[:2]) for n in range(2)}
    with Session(engine) as s:
        assert s.scalar(select(Trial.id).where(Trial.id == ids[0])) is not None
    pareto = add_study(engine, "quickstart-pareto", "COMPLETED", PARETO_OBJECTIVES, PARETO_TRIALS)
    values = add_bare_trials(engine, pareto, range(PARETO_TRIALS), objectives=2)
    return Seeded(finished.id, running.id, ids, run_ids, pareto, values)
