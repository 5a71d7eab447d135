"""Everything that crosses Ray between a slot worker and the study runner, as typed structs.

A worker sends, through the runner's `TrialInbox` (workers/inbox.py):

- `Started`: a member began an execution on this worker (where, when, which execution);
- `Report`: one evaluation of a member (its metric points at a step, and the value of the
  study's pruned objective had the trial stopped there, computed by the worker);
- a member's end, one of `Stopped` (completed, pruned or diverged, with its summary),
  `HandedBack` (untrained here: no slot fitted it, or the device ran out of memory) or
  `Failed` (this member cannot be trained, with the reason);

and returns `WorkerDone` when its task ends, or raises `WorkerOutOfMemory` when it ran out
of memory where it could not hand its members back itself. The runner assigns trials as
`Assignment`s. Every end names the worker that sent it: the runner acts on an end only if
that worker still holds the trial. Frozen dataclasses with slots: they pickle small and fast
(faster than pydantic models, no dependency beyond the standard library), and mypy checks
every field where a tuple or dict read by string keys would not be checked at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.config import TrialConfig, TrialSummary
from workers.stopping import StopRule

__all__ = [
    "Assignment",
    "Batch",
    "End",
    "Failed",
    "HandedBack",
    "Point",
    "Report",
    "Started",
    "Stopped",
    "WorkerDone",
    "WorkerOutOfMemory",
]

# (name, layer, head, value): one reported number; layer/head None where it has none.
Point = tuple[str, int | None, int | None, float]


@dataclass(frozen=True, slots=True)
class Assignment:
    """A trial the runner gives a worker: its number, its full config and the rules that
    stop it once it can no longer meet the study's constraints; `objective`: the summary
    metric whose intermediate value each report carries (the study's pruned objective; None
    without a pruner). The config is the runner's own validated `TrialConfig` (a trial whose
    parameters give no valid config fails in the runner and is never assigned); it crosses
    Ray pickled, like `Stopped.summary`, and the worker trains it as it comes."""

    trial: int
    config: TrialConfig
    stop_rules: tuple[StopRule, ...] = ()
    objective: str | None = None


@dataclass(frozen=True, slots=True)
class Started:
    worker: str
    trial: int
    execution: str  # a fresh id per execution (admission) of the trial
    node: str
    at: float  # unix time, the worker's clock


@dataclass(frozen=True, slots=True)
class Report:
    """One evaluation. `value`: the trial's summary of the assignment's `objective` had it
    stopped after this evaluation (None without an objective, at step 0, or NaN; +inf for a
    running maximum that overflowed, docs/metrics.md section 9):
    what the runner hands Optuna's pruner, as computed by the worker that trained it."""

    trial: int
    execution: str
    step: int
    points: list[Point]
    value: float | None = None


@dataclass(frozen=True, slots=True)
class Stopped:
    """A member stopped on its own (completed, pruned, diverged): its summary and times."""

    worker: str
    trial: int
    execution: str
    summary: TrialSummary
    node: str
    started_at: float
    finished_at: float
    reports_sent: int  # the runner records it once it has stored this many reports


@dataclass(frozen=True, slots=True)
class HandedBack:
    """A member given back untrained (it resumes from its checkpoint elsewhere); `slots`:
    how many members this worker found room for, so the runner sizes the next worker."""

    worker: str
    trial: int
    slots: int


@dataclass(frozen=True, slots=True)
class Failed:
    """A member that cannot be trained (e.g. out of memory alone in its worker)."""

    worker: str
    trial: int
    reason: str


End = Stopped | HandedBack | Failed


class WorkerOutOfMemory(Exception):
    """What a slot worker's task raises when its process ran out of memory (device or host)
    outside an admission or a step, where it hands its members back itself (`HandedBack`).
    The runner tells it by its type (the `cause` of Ray's `RayTaskError`), as it tells Ray's
    own `OutOfMemoryError` (the memory monitor killed the task): either way the worker's key
    gets one slot fewer (service/runner/pool.py, `out_of_memory`)."""


@dataclass(frozen=True, slots=True)
class WorkerDone:
    """What a slot worker's task returns when it ends on its own."""

    worker: str
    node: str
    members: int  # members admitted in its life
    steps: int  # member-steps it trained


@dataclass(slots=True)
class Batch:
    """What arrived at the inbox since the runner last took from it."""

    starts: list[Started] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    ends: list[End] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.starts or self.reports or self.ends)

    def extend(self, other: Batch) -> None:
        self.starts += other.starts
        self.reports += other.reports
        self.ends += other.ends
