"""Trials whose end has arrived, held until their last reports are stored, then recorded.

A trial's result and its reports travel separately (the result as a task's return value or
a slot's `finished` message, the reports through the inbox's stream), so either may arrive
first. A result is held here until the runner has stored as many reports of that execution
as the trial says it sent (or `FLUSH_TIMEOUT_S` passed), then `Outcomes` records and tells
it and the trial leaves the open registry of `TrialEvents`. A failure is recorded at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from service.outcomes import Outcomes
from service.trial_events import Running, TrialEvents

__all__ = ["FLUSH_TIMEOUT_S", "Finishing"]

log = logging.getLogger("qkscope.runner")
FLUSH_TIMEOUT_S = 60.0  # a finished trial waits at most this long for its last reports


@dataclass
class _Held:
    entry: Running
    result: dict[str, Any]
    since: float


class Finishing:
    """The runner's finished-but-not-yet-recorded trials (runs on the runner's thread)."""

    def __init__(self, outcomes: Outcomes, events: TrialEvents) -> None:
        self.outcomes, self.events = outcomes, events
        self._held: dict[int, _Held] = {}

    def __contains__(self, number: int) -> bool:
        return number in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, entry: Running, result: dict[str, Any]) -> None:
        """Keep a returned result until its reports are stored (the first one counts)."""
        if entry.number not in self._held:
            self._held[entry.number] = _Held(entry, result, time.monotonic())

    def record_ready(self) -> None:
        """Record the held trials whose reports have all been stored."""
        for number, held in list(self._held.items()):
            sent = int(held.result.get("reports_sent", 0))
            got = held.entry.received.get(str(held.result.get("execution", "")), 0)
            if got < sent and time.monotonic() - held.since < FLUSH_TIMEOUT_S:
                continue
            if got < sent:
                log.warning("trial %d: %d of %d reports arrived; finishing", number, got, sent)
            self._record(number)

    def record_all(self) -> None:
        """Record every held trial now (a cancel: what arrived before it is kept)."""
        for number in list(self._held):
            self._record(number)

    def fail(self, entry: Running, reason: str) -> None:
        """Record a failure at once (Ray's retries, or the worker's, are used up)."""
        self._held.pop(entry.number, None)
        self.outcomes.fail(entry, reason)
        self.events.forget(entry.number)
        log.warning("trial %d failed: %s", entry.number, reason)

    def _record(self, number: int) -> None:
        held = self._held.pop(number)
        self.outcomes.finish(held.entry, held.result)
        self.events.forget(number)
