"""Ray glue for one trial: the task a worker node runs and the inbox it reports to.

The study runner owns a `TrialInbox` actor; each trial task reports every
evaluation to it and learns from the answer whether the runner has decided to
prune it. The runner drains the inbox in batches, so the database and Optuna
live only in the runner process, and a GPU node needs only `workers` + Ray.
Prune decisions therefore arrive one evaluation late; that costs at most
`eval_every` steps of a pruned trial and keeps training free of database waits.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import ray

from workers.trial import MetricPoint, TrialConfig, run_trial

__all__ = ["InboxReporter", "Report", "Start", "TrialInbox", "run_trial_task"]

Report = tuple[int, int, list[tuple[str, int | None, int | None, float]]]  # (trial, step, points)
JOURNAL = "reports.jsonl"
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
    """A `workers.trial.Reporter` that forwards to a TrialInbox actor.

    With a journal (a file beside the trial's checkpoint, on storage every node
    reaches), each report is appended there before it is sent. Reports still in
    the inbox when the runner dies would otherwise be lost for good, because the
    trial resumes after its checkpoint and never repeats them; `replay()` sends
    the journal again and the metric primary key makes repeats no-ops.
    """

    def __init__(self, inbox: Any, trial: int, journal: Path | None = None) -> None:
        self._inbox, self._trial, self._journal = inbox, trial, journal

    def replay(self) -> int:
        """Send every journaled report again; returns how many there were."""
        if self._journal is None or not self._journal.exists():
            return 0
        refs = []
        with self._journal.open() as f:
            for line in f:
                try:
                    step, points = json.loads(line)
                except ValueError:  # a line torn by a crash mid-write
                    continue
                refs.append(self._inbox.put.remote(self._trial, step, [tuple(p) for p in points]))
        ray.get(refs)
        return len(refs)

    def report(self, step: int, metrics: list[MetricPoint]) -> bool:
        points = [(p.name, p.layer, p.head, p.value) for p in metrics]
        if self._journal is not None:
            self._journal.parent.mkdir(parents=True, exist_ok=True)
            with self._journal.open("a") as f:
                f.write(json.dumps([step, points]) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return bool(ray.get(self._inbox.put.remote(self._trial, step, points)))


def run_trial_task(config: dict[str, Any], trial: int, inbox: Any) -> dict[str, Any]:
    """Body of the Ray task: run (or resume from checkpoint) and return the summary.

    Each execution announces itself first, so a Ray retry after a lost node or a
    crashed worker is counted in the trial's `attempts`.
    """
    node = f"{socket.gethostname()}:{ray.get_runtime_context().get_node_id()[:12]}"
    ray.get(inbox.started.remote(trial, node))
    parsed = TrialConfig.model_validate(config)
    ckpt_dir = parsed.checkpoint.dir
    reporter = InboxReporter(inbox, trial, Path(ckpt_dir) / JOURNAL if ckpt_dir else None)
    reporter.replay()
    summary = run_trial(parsed, reporter)
    return {"summary": summary.model_dump(mode="json"), "node": node, "pid": os.getpid()}
