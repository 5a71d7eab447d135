"""One record per trial in the runner, with one status whose only owner is the scheduler.

    ASKED ──place──> PLACED ──Started──> RUNNING ──Stopped──> FINISHING ──recorded──> DONE
      ^                 │                    │
      └── handed back, or its worker ended ──┘              (a failure: straight to DONE)

- ASKED: Optuna asked it and our row is QUEUED; it waits for a slot.
- PLACED: assigned to a slot worker that has not started it yet.
- RUNNING: its worker started it (an execution); it reports.
- FINISHING: its worker sent its end; the slot is free; the outcome waits until every
  report of that execution is stored.
- DONE: outcome recorded and told to Optuna; the record is gone from the scheduler.

Everything else a record carries (reports received, the steps told to Optuna) is
bookkeeping that the reports and results code read and update; none of it moves the
status.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import optuna

from workers.config import TrialConfig
from workers.messages import Stopped
from workers.stopping import StopRule

__all__ = ["Status", "TrialRecord"]


class Status(enum.Enum):
    ASKED = "asked"
    PLACED = "placed"
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"


@dataclass(eq=False)
class TrialRecord:
    """A trial from Optuna's ask to its recorded outcome."""

    trial: optuna.Trial
    row_id: int
    params: dict[str, Any]
    config: TrialConfig | None  # None: its parameters give no valid config (it fails)
    key: str = ""  # which slot workers may train it (service/runner/configs.py: slot_key)
    slots: int = 1  # the slots a new worker of its key gets
    stop_rules: tuple[StopRule, ...] = ()  # the constraints its worker checks
    status: Status = Status.ASKED
    worker: str | None = None  # the slot worker that holds it (PLACED, RUNNING)
    starts: int = 0  # executions started in this runner; the 2nd and later are retries
    attempts_before: int = 0  # executions counted in its row before this runner took it
    losses: int = 0  # workers that ended while holding it (bounded by max_retries)
    launched: float = field(default_factory=time.monotonic)
    result: Stopped | None = None  # FINISHING: the end its worker sent
    finishing_since: float = 0.0
    received: dict[str, int] = field(default_factory=dict)  # reports stored per execution
    reported: set[int] = field(default_factory=set)  # steps whose value went to the pruner

    @property
    def number(self) -> int:
        return int(self.trial.number)

    @property
    def queued(self) -> bool:
        """Not started anywhere yet (QUEUED in our table)."""
        return self.status in (Status.ASKED, Status.PLACED) and self.starts == 0

    def reports_in(self) -> bool:
        """FINISHING and every report of the ending execution stored."""
        r = self.result
        return r is not None and self.received.get(r.execution, 0) >= r.reports_sent
