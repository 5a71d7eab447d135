"""Runner fencing: every write a study runner makes holds only while its job attempt is the
study's current one.

A study's runner job is launched as attempt `n` (`qk_study.job_attempts`, claimed before the
job is submitted: service/control/launch.py). When the reconciler launches attempt `n + 1`
(it judged job `n` dead, or a submission's answer was lost) while runner `n` still runs, two
runners would write one study. So each write transaction of a runner starts with its fence:
a conditional no-op UPDATE of the study row, `WHERE job_attempts = n`. It matches nothing
once another attempt was claimed, and the transaction raises `Superseded` (its writes roll
back: a stale runner's write changes nothing). It also locks the study row until the
transaction commits (PostgreSQL: a row lock; SQLite: the database's write lock), so a claim
of the next attempt waits for a write that began under the current one: a new runner, which
starts after its claim, sees every write the old one made, and none comes after.

Optuna is never told anything by a stale runner: the runner tells Optuna only after its
fenced write of the same outcome committed (service/runner/loop.py), and checks its fence
before each ask.

A runner that meets `Superseded` exits without touching rows and without marking the study
FAILED (service/runner/job.py): the current runner owns the study.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.store.models import Study

__all__ = ["Fence", "Superseded", "check_fence"]


@dataclass(frozen=True, slots=True)
class Fence:
    """Whose writes: runner job attempt `attempt` of study `study_id`."""

    study_id: int
    attempt: int


class Superseded(RuntimeError):
    """The runner's attempt is no longer the study's current one: its write changed nothing,
    and the runner must exit (it is neither a failure of the study nor a database outage)."""

    def __init__(self, fence: Fence, current: int | None) -> None:
        super().__init__(
            f"study {fence.study_id}: runner attempt {fence.attempt} was superseded "
            f"(the study's current attempt is {current})"
        )
        self.fence, self.current = fence, current


def check_fence(s: Session, fence: Fence | None) -> None:
    """The first statement of a fenced write transaction: lock the study row if `fence` is
    its current attempt, else raise `Superseded`. No-op without a fence (the API's writes,
    the reconciler's)."""
    if fence is None:
        return
    mine = update(Study).where(Study.id == fence.study_id, Study.job_attempts == fence.attempt)
    matched = s.execute(mine.values(job_attempts=Study.job_attempts)).rowcount  # type: ignore[attr-defined]
    if matched != 1:
        current = s.scalar(select(Study.job_attempts).where(Study.id == fence.study_id))
        raise Superseded(fence, current)
