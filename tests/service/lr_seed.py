"""An lr x qk_norm x seed grid study written through the real store with made-up losses, and
the LR-sensitivity numbers those losses give, computed here independently of
service/read/lr_sensitivity.py (the route, client, CLI and UI tests read it)."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from sqlalchemy import Engine

from service.spec import parse_spec
from service.store import Store
from service.store.session import make_sessionmaker
from service.store.trials import ResultRow, StartRow

T_2DF = 4.302652729911275  # Student t, 97.5 % quantile, 2 degrees of freedom (tables)

E2E_GRID = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]


SEEDS = [0, 1, 2]


NORMS = ["none", "layernorm"]


def lr_spec(name: str, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "base": {"steps": 100, "eval_every": 50, "eval_at_init": True},
        "search_space": {
            "optim.lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True,
                         "grid": E2E_GRID},
            "model.qk_norm": {"type": "categorical", "choices": NORMS},
            "seed": {"type": "int", "low": 0, "high": 10, "grid": SEEDS},
        },
        "sampler": {"kind": "grid", "seed": 0},
        "budget": {"n_trials": len(E2E_GRID) * len(SEEDS) * len(NORMS) + 2},
    }  # fmt: skip
    spec.update(over)
    return spec


def l0_of(norm: str, seed: int) -> float:
    return 7.6 + 0.01 * seed + (0.05 if norm == "layernorm" else 0.0)


def final_of(norm: str, seed: int, eta: float) -> float | None:
    """None: diverged. Without qk-layernorm the top lr diverges and 0.1 ends above l0."""
    if norm == "none" and eta == 1.0:
        return None
    if norm == "none" and eta == 0.1:
        return 8.0 + 0.1 * seed
    return 3.0 + 0.3 * (math.log10(eta) + 2.5) ** 2 + 0.02 * seed


def write_trial(
    store: Store, sid: int, number: int, norm: str, seed: int, eta: float, state: str | None
) -> None:
    """What the runner writes for one trial: its row, its start, its step-0 and final
    evaluations, and its result (`state` None: left RUNNING)."""
    params = {"optim.lr": eta, "model.qk_norm": norm, "seed": seed}
    rid = store.trials.insert_queued(sid, number, params, seed)
    store.trials.record_starts({rid: StartRow("node-a", 1, 1.7e9)})
    l0, final = l0_of(norm, seed), final_of(norm, seed, eta)
    last = math.nan if final is None else final
    store.trials.store_reports(
        [(rid, 0, "val_loss", None, None, l0), (rid, 100, "val_loss", None, None, last)]
    )
    if state is None:
        return
    diverged = final is None
    summary = {
        "status": "diverged" if diverged else state.lower(),
        "steps_done": 50 if diverged else 100,
        "final_val_loss": final,
        "init_val_loss": l0,
        **({"diverged_at_step": 50} if diverged else {}),
    }
    row = ResultRow(
        state="DIVERGED" if diverged else state,  # type: ignore[arg-type]
        summary=summary,
        node="node-a",
        values=[last],
        feasible=True,
        last_step=100,
        started_at=None,
        finished_at=None,
        duration_s=1.0,
    )
    assert store.trials.record_result(rid, row)


def expected_group(norm: str) -> dict[str, Any]:
    """The group's numbers computed here from final_of/l0_of, independently of the module."""
    per_seed = []
    for seed in SEEDS:
        l0 = l0_of(norm, seed)
        ls = [final_of(norm, seed, eta) for eta in E2E_GRID]
        ls2 = [l0 if v is None else v for v in ls]
        best = min(ls2)
        per_seed.append(sum(min(v, l0) - best for v in ls2) / len(ls2))
    mean = sum(per_seed) / len(per_seed)
    half = T_2DF * statistics.stdev(per_seed) / math.sqrt(len(per_seed))
    return {"per_seed": per_seed, "mean": mean, "lo": mean - half, "hi": mean + half}


def _parse(body: dict[str, Any]) -> Any:
    return parse_spec(json.dumps(body).encode(), "json")


def write_grid(store: Store, sid: int) -> int:
    """Every (qk_norm, seed, lr) trial of the grid, finished; the number of trials."""
    n = 0
    for norm in NORMS:
        for seed in SEEDS:
            for eta in E2E_GRID:
                write_trial(store, sid, n, norm, seed, eta, "COMPLETE")
                n += 1
    return n


def seed_lr_study(engine: Engine, name: str = "lr-sens") -> int:
    """An lr x qk_norm x seed grid study written through the store (every trial finished),
    plus seed 3 of "none": lr 1e-4 finished, 1e-3 still running, 1e-2 pruned, the rest not
    asked yet. Its id."""
    store = Store(make_sessionmaker(engine))
    study, _ = store.studies.create(_parse(lr_spec(name)))
    sid = int(study.id)
    n = write_grid(store, sid)
    write_trial(store, sid, n, "none", 3, 1e-4, "COMPLETE")
    write_trial(store, sid, n + 1, "none", 3, 1e-3, None)
    write_trial(store, sid, n + 2, "none", 3, 1e-2, "PRUNED")
    return sid


# --- a new user's first grid up to lr 3 (issue 46, item 6) ------------------------------------

BLOWUP_GRID = [1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0]
BLOWUP_L0 = 2.9
# Final validation losses by lr: two runs blew up to hundreds of nats and stayed finite
# (COMPLETE, not diverged); the last went non-finite (DIVERGED).
BLOWUP_FINALS: list[float | None] = [2.3, 2.0, 1.8, 1.7, 1.9, 137.0, 284.0, None]
BLOWUP_STEPS = [0, 25, 50, 75, 100]


def blowup_curve(final: float | None) -> list[float]:
    """val_loss at BLOWUP_STEPS: from l0 down towards `final`, a blown-up run going up only
    in its last quarter (the non-finite one is NaN from step 75)."""
    if final is None:
        return [BLOWUP_L0, 2.5, 2.4, math.nan, math.nan]
    if final > BLOWUP_L0:
        return [BLOWUP_L0, 2.5, 2.3, final / 4, final]
    return [BLOWUP_L0 - (BLOWUP_L0 - final) * f for f in (0.0, 0.6, 0.8, 0.95, 1.0)]


def seed_blowup_study(engine: Engine, name: str = "first-grid") -> tuple[int, dict[float, int]]:
    """One seed of an lr grid up to 3, no description, written through the real store as the
    runner writes it (step-0 and later val_loss and train_loss rows, then the result). Its
    id and the trial id of each lr."""
    store = Store(make_sessionmaker(engine))
    spec = lr_spec(name)
    spec["search_space"] = {
        "optim.lr": {"type": "float", "low": 1e-3, "high": 3.0, "log": True, "grid": BLOWUP_GRID}
    }
    spec["budget"] = {"n_trials": len(BLOWUP_GRID)}
    study, _ = store.studies.create(_parse(spec))
    sid = int(study.id)
    ids: dict[float, int] = {}
    for n, (eta, final) in enumerate(zip(BLOWUP_GRID, BLOWUP_FINALS, strict=True)):
        rid = store.trials.insert_queued(sid, n, {"optim.lr": eta}, 0)
        ids[eta] = rid
        store.trials.record_starts({rid: StartRow("node-a", 1, 1.7e9)})
        val = blowup_curve(final)
        rows = [
            (rid, st, "val_loss", None, None, v) for st, v in zip(BLOWUP_STEPS, val, strict=True)
        ]
        rows += [
            (rid, st or 1, "train_loss", None, None, v * 1.01)
            for st, v in zip(BLOWUP_STEPS, val, strict=True)
        ]
        store.trials.store_reports(rows)
        diverged = final is None
        summary = {
            "status": "diverged" if diverged else "complete",
            "steps_done": 75 if diverged else 100,
            "final_val_loss": final,
            "init_val_loss": BLOWUP_L0,
            **({"diverged_at_step": 75} if diverged else {}),
        }
        row = ResultRow(
            state="DIVERGED" if diverged else "COMPLETE",
            summary=summary,
            node="node-a",
            values=[math.nan if final is None else final],
            feasible=True,
            last_step=100,
            started_at=None,
            finished_at=None,
            duration_s=1.0,
        )
        assert store.trials.record_result(rid, row)
    return sid, ids


def seed_char_lm_study(engine: Engine, name: str, data_dir: str) -> int:
    """The lr x qk_norm x seed grid of `seed_lr_study` (every trial finished, l* about 3.1
    nats) on a character-level `lm` task over `data_dir` (train.txt, valid.txt), so its
    LR-sensitivity answer carries the unigram floor of that data. Its id."""
    base = {"steps": 100, "eval_every": 50, "eval_at_init": True, "batch_size": 1,
            "eval_batches": 1, "task": {"kind": "lm", "data_dir": data_dir, "tokenizer": "char",
                                        "seq_len": 8}}  # fmt: skip
    store = Store(make_sessionmaker(engine))
    study, _ = store.studies.create(_parse(lr_spec(name, base=base)))
    write_grid(store, int(study.id))
    return int(study.id)
