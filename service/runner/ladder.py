"""The width ladder's bisection (METRICS.md section 11, `stability` in a study definition).

A ladder study first runs its grid (`optim.lr` x width x seed x anything else searched).
Then, for every width and seed (and every value of the other searched parameters: one
"cell"), the runner adds trials in `log eta`: while the cell's bracket `eta_u / eta_s`
(the first unstable learning rate above the best one and the one tried just below it) is
above `bisect_factor`, one trial at `sqrt(eta_s eta_u)`; its result moves `eta_s` or `eta_u`
to it, halving `log(eta_u / eta_s)`. A bracket of ratio `r` takes
`ceil(log2(log r / log factor))` trials (one grid step of 10x down to sqrt(2): 3).

Stable and unstable are decided exactly as the stability-boundary route decides them (the
same `service.read.stability_boundary`, on the study's rows), so the trials the ladder adds
are the ones that route reads. A cell bisects only when every trial of it has a result
(one bisection trial at a time per cell, each placed from the last one's result). Cells
whose boundary is undefined (the grid does not reach it, or nothing trained) get nothing:
bisection refines a bracket, it does not search for one.

`proposals` decides on a computed answer alone (no database, no cluster); `Ladder` is the
runner's side: after the grid is asked, it reads the answer again whenever a trial
finished and hands the runner the parameters to enqueue.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from service.read.stability_boundary import StabilityBoundary, study_stability_boundary
from service.spec import IntParam, StudySpec
from service.store import Store, session_scope

__all__ = ["Ladder", "grid_size", "proposals"]

LR_PARAM = "optim.lr"
SEED_PARAM = "seed"


def grid_size(spec: StudySpec) -> int:
    """Points of the study's grid (the grid sampler's product of grids and choices)."""
    n = 1
    for p in spec.search_space.values():
        if p.type == "categorical":
            n *= len(p.choices)
        elif p.type in ("float", "int"):
            n *= len(set(p.grid or [None]))
    return n


def proposals(spec: StudySpec, answer: StabilityBoundary) -> list[dict[str, Any]]:
    """The next bisection trial of every cell that needs one: its searched parameters, with
    `optim.lr` at `sqrt(eta_s eta_u)`. A cell needs one when its `eta_max` is defined, every
    trial of it has a result, and `eta_u / eta_s > bisect_factor`."""
    st = spec.stability
    if st is None or st.bisect_factor is None:
        return []
    factor = st.bisect_factor
    out: list[dict[str, Any]] = []
    for g in answer.groups:
        for p in g.points:
            if p.eta_s is None or p.eta_u is None or p.unfinished:
                continue
            if p.eta_u / p.eta_s <= factor * (1 + 1e-9):
                continue
            params = {**g.params, answer.width: p.width, SEED_PARAM: p.seed}
            params[LR_PARAM] = math.sqrt(p.eta_s * p.eta_u)
            out.append(_typed(spec, params))
    return out


def _typed(spec: StudySpec, params: dict[str, Any]) -> dict[str, Any]:
    """Each value as its search-space parameter takes it (an int parameter an int), and the
    fixed ones as they are: what `suggest` would give for these values."""
    out: dict[str, Any] = {}
    for path, p in spec.search_space.items():
        if p.type == "fixed":
            continue
        if path in params:
            v = params[path]
        elif p.type == "categorical":  # one choice: not a group parameter
            v = p.choices[0]
        else:
            v = (p.grid or [p.low])[0]
        if isinstance(p, IntParam):
            v = int(round(v))
        elif p.type == "categorical":  # the choice itself (16, not the answer's 16.0)
            v = next((c for c in p.choices if c == v), v)
        out[path] = v
    return out


class Ladder:
    """The runner's bisection: `next()` is the parameters of the next trial to enqueue, or
    None while no cell needs one now (re-read after `changed()`, i.e. a trial finished)."""

    def __init__(
        self,
        spec: StudySpec,
        study_id: int,
        store: Store,
        read: Callable[[], StabilityBoundary] | None = None,
    ) -> None:
        self.spec, self.study_id, self.store = spec, study_id, store
        self.grid = grid_size(spec)
        self._read = read or self._read_rows
        self._queue: deque[dict[str, Any]] = deque()
        self._stale = True

    @staticmethod
    def wanted(spec: StudySpec) -> bool:
        return spec.stability is not None and spec.stability.bisect_factor is not None

    def changed(self) -> None:
        """A trial of the study got its result: the brackets may have moved."""
        self._stale = True

    def pending(self) -> bool:
        """Whether a proposal waits to be asked (or a re-read may give one)."""
        return bool(self._queue) or self._stale

    def next(self) -> dict[str, Any] | None:
        if not self._queue and self._stale:
            self._stale = False
            self._queue.extend(proposals(self.spec, self._read()))
        return self._queue.popleft() if self._queue else None

    def _read_rows(self) -> StabilityBoundary:
        with session_scope(self.store.reader()) as s:
            row = self.store.studies.get(self.study_id)
            assert row is not None
            return study_stability_boundary(s, row)
