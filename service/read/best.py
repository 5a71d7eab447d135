"""A study's best trial (one objective) or its Pareto front (several), in bounded memory.

The front is found from the trials' objective values alone (`id`, `values`: a few numbers a
trial), and only the trials on it are then loaded, each with its bounded summary
(service/read/summaries.py). Before, every COMPLETE trial was loaded whole, summaries and
their per-evaluation lists included: about 310 MiB a request at 300 trials of 10,000
evaluations (issue 42). The front itself is found in O(n x front) comparisons (sorted first:
a point's dominators come before it), not O(n^2).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.read.summaries import trials_with_bounded_summaries
from service.store import Study, Trial, TrialState

__all__ = ["best_trials", "pareto_front"]

Key = tuple[float, ...]


def _dominates(a: Key, b: Key) -> bool:
    """`a` is no worse than `b` everywhere and differs (both minimised)."""
    return a != b and all(x <= y for x, y in zip(a, b, strict=True))


def pareto_front(keys: Sequence[tuple[int, Key]]) -> list[int]:
    """The ids whose key no other key dominates (every objective minimised), by key. Equal
    keys are kept together (neither dominates the other)."""
    front: list[tuple[int, Key]] = []
    for tid, key in sorted(keys, key=lambda x: (x[1], x[0])):
        # Sorted lexicographically, every point that dominates `key` comes before it, and a
        # dominated one is dominated by some point of the front (dominance is transitive).
        if not any(_dominates(f, key) for _, f in front):
            front.append((tid, key))
    return [tid for tid, _ in front]


def best_trials(session: Session, study: Study, feasible_only: bool = True) -> list[Trial]:
    """The best COMPLETE trial (one objective) or the Pareto front (several), each with its
    bounded summary; feasible trials only unless `feasible_only` is false. A trial without
    every objective value is left out."""
    directions = [o["direction"] for o in study.spec["objectives"]]
    sign = [1.0 if d == "minimize" else -1.0 for d in directions]
    q = select(Trial.id, Trial.values).where(
        Trial.study_id == study.id, Trial.state == TrialState.COMPLETE
    )
    if feasible_only:
        q = q.where(Trial.feasible.is_not(False))
    keys: list[tuple[int, Key]] = []
    for tid, values in session.execute(q):
        if values and None not in values and len(values) == len(sign):
            keys.append((int(tid), tuple(s * float(v) for s, v in zip(sign, values, strict=True))))
    front = pareto_front(keys)
    if not front:
        return []
    rows = trials_with_bounded_summaries(session, select(Trial).where(Trial.id.in_(front)))
    order = {tid: i for i, tid in enumerate(front)}
    return sorted(rows, key=lambda t: order[t.id])
