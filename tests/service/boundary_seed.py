"""An lr x d_model x qk_norm x seed grid study written through the real store with made-up
losses whose stability boundary is known from how they are generated (the route, client,
CLI and UI tests of GET /v1/studies/{id}/stability-boundary read it)."""

from __future__ import annotations

import json
import math
from typing import Any

from sqlalchemy import Engine

from service.spec import parse_spec
from service.store import Store
from service.store.session import make_sessionmaker
from service.store.trials import ResultRow, StartRow

GRID = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0]
WIDTHS = [32, 64, 128]
SEEDS = [0, 1]
NORMS = ["none", "layernorm"]
# one bisection trial: width 64, seed 0, norm none, between its eta_s and eta_u
BISECT = (64, 0, "none")


def boundary_spec(name: str, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "base": {"steps": 100, "eval_every": 50, "eval_at_init": True,
                 "model": {"n_layers": 1, "n_heads": 2, "d_model": 32}},
        "search_space": {
            "optim.lr": {"type": "float", "low": 1e-3, "high": 1.0, "log": True, "grid": GRID},
            "model.d_model": {"type": "int", "low": 32, "high": 128, "grid": WIDTHS},
            "model.qk_norm": {"type": "categorical", "choices": NORMS},
            "seed": {"type": "int", "low": 0, "high": 10, "grid": SEEDS},
        },
        "sampler": {"kind": "grid", "seed": 0},
        "budget": {"n_trials": len(GRID) * len(WIDTHS) * len(SEEDS) * len(NORMS) + 2},
    }  # fmt: skip
    spec.update(over)
    return spec


def boundary_of(norm: str, width: int, seed: int) -> float:
    """Above this learning rate a trial diverges: ~ width^-1 (layernorm: 3x higher)."""
    return (0.5 if norm == "none" else 1.5) * (32 / width) * (1.0 + 0.1 * seed)


def opt_of(width: int) -> float:
    return 0.01 * (32 / width) ** 0.5


def l0_of(norm: str, seed: int) -> float:
    return 6.0 + 0.01 * seed + (0.02 if norm == "layernorm" else 0.0)


def final_of(norm: str, width: int, seed: int, eta: float) -> float | None:
    """None: diverged. A shallow bowl in log eta below the boundary (all within tau)."""
    if eta > boundary_of(norm, width, seed):
        return None
    return 3.0 + 0.05 * math.log(eta / opt_of(width)) ** 2


def bracket(norm: str, width: int, seed: int, lrs: list[float]) -> tuple[float, float]:
    """(eta_s, eta_u) from the generating rule: the last rate below the boundary and the
    first above it."""
    b = boundary_of(norm, width, seed)
    return max(e for e in lrs if e <= b), min(e for e in lrs if e > b)


def bisect_lr() -> float:
    lo, hi = bracket(BISECT[2], BISECT[0], BISECT[1], GRID)
    return math.sqrt(lo * hi)


def write_trial(
    store: Store, sid: int, number: int, norm: str, width: int, seed: int, eta: float,
    state: str | None, extra: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """What the runner writes for one trial (`state` None: left RUNNING)."""
    params = {"optim.lr": eta, "model.d_model": width, "model.qk_norm": norm, "seed": seed}
    rid = store.trials.insert_queued(sid, number, params, seed)
    store.trials.record_starts({rid: StartRow("node-a", 1, 1.7e9)})
    l0, final = l0_of(norm, seed), final_of(norm, width, seed, eta)
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
        "eval_steps": [0, 50, 100],  # per-evaluation lists the read must not need
        "val_losses": [l0, l0, final],  # JSON null where it diverged, as the runner stores it
        **({"diverged_at_step": 50} if diverged else {}),
        **(extra or {}),
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


def seed_boundary_study(engine: Engine, name: str = "boundary") -> int:
    """Every grid trial finished, plus one bisection trial (BISECT) and one RUNNING trial
    (width 128, seed 1, layernorm, at the bisection rate). Its id."""
    store = Store(make_sessionmaker(engine))
    study, _ = store.studies.create(parse_spec(json.dumps(boundary_spec(name)).encode(), "json"))
    sid = int(study.id)
    n = 0
    for norm in NORMS:
        for width in WIDTHS:
            for seed in SEEDS:
                for eta in GRID:
                    write_trial(store, sid, n, norm, width, seed, eta, "COMPLETE")
                    n += 1
    w, s, norm = BISECT
    write_trial(store, sid, n, norm, w, s, bisect_lr(), "COMPLETE")
    write_trial(store, sid, n + 1, "layernorm", 128, 1, bisect_lr(), None)
    return sid
