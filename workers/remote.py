"""Ray glue for one trial: the task a worker node runs and the inbox it reports to.

The study runner owns a `TrialInbox` actor; each trial task reports every
evaluation to it and learns from the answer whether the runner has decided to
prune it. The runner drains the inbox in batches, so the database and Optuna
live only in the runner process, and a GPU node needs only `workers` + Ray.
Prune decisions therefore arrive one evaluation late; that costs at most
`eval_every` steps of a pruned trial and keeps training free of database waits.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from workers.trial import MetricPoint, TrialConfig, run_trial

__all__ = ["InboxReporter", "Report", "Start", "TrialInbox", "run_trial_task"]

Report = tuple[int, int, list[tuple[str, int | None, int | None, float]]]  # (trial, step, points)
Start = tuple[int, str]  # (trial, node): one execution of a trial task began


@ray.remote(num_cpus=0)
class TrialInbox:
    """Buffers trial reports until the runner drains them; holds prune decisions."""

    def __init__(self) -> None:
        self._reports: list[Report] = []
        self._starts: list[Start] = []
        self._prune: set[int] = set()

    def started(self, trial: int, node: str) -> None:
        self._starts.append((trial, node))

    def drain_starts(self) -> list[Start]:
        starts, self._starts = self._starts, []
        return starts

    def put(
        self, trial: int, step: int, points: list[tuple[str, int | None, int | None, float]]
    ) -> bool:
        self._reports.append((trial, step, points))
        return trial in self._prune

    def drain(self) -> list[Report]:
        reports, self._reports = self._reports, []
        return reports

    def prune(self, trial: int) -> None:
        self._prune.add(trial)


class InboxReporter:
    """A `workers.trial.Reporter` that forwards to a TrialInbox actor."""

    def __init__(self, inbox: Any, trial: int) -> None:
        self._inbox, self._trial = inbox, trial

    def report(self, step: int, metrics: list[MetricPoint]) -> bool:
        points = [(p.name, p.layer, p.head, p.value) for p in metrics]
        return bool(ray.get(self._inbox.put.remote(self._trial, step, points)))


def run_trial_task(config: dict[str, Any], trial: int, inbox: Any) -> dict[str, Any]:
    """Body of the Ray task: run (or resume from checkpoint) and return the summary.

    Each execution announces itself first, so a Ray retry after a lost node or a
    crashed worker is counted in the trial's `attempts`.
    """
    node = f"{socket.gethostname()}:{ray.get_runtime_context().get_node_id()[:12]}"
    ray.get(inbox.started.remote(trial, node))
    summary = run_trial(TrialConfig.model_validate(config), InboxReporter(inbox, trial))
    return {"summary": summary.model_dump(mode="json"), "node": node, "pid": os.getpid()}
