"""Saying why trials wait: when no alive node of the cluster can ever run a study's trials
(too many CPUs or GPUs asked), the study and its queued trials carry a `waiting_reason`
instead of staying QUEUED without a word; it is cleared when trials can start again."""

from __future__ import annotations

import logging
import math
import time

import ray

from service.resources import unmet
from service.spec import StudySpec
from service.store import StudyRows

__all__ = ["WAIT_CHECK_S", "WaitingReason"]

log = logging.getLogger("qkscope.runner")
WAIT_CHECK_S = 10.0  # how often queued trials are checked against the cluster's nodes


class WaitingReason:
    """Checks, at most every WAIT_CHECK_S, whether queued trials can run anywhere."""

    def __init__(self, spec: StudySpec, studies: StudyRows, study_id: int) -> None:
        self.spec, self.studies, self.study_id = spec, studies, study_id
        self._reason: str | None = None
        self._checked = -math.inf

    def check(self, queued: list[int]) -> None:
        """`queued`: row ids of the study's trials that have not started."""
        now = time.monotonic()
        if now - self._checked < WAIT_CHECK_S:
            return
        self._checked = now
        reason = None
        if queued:
            alive = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
            nodes = [dict(n.get("Resources") or {}) for n in alive]
            res = self.spec.resources
            if problems := unmet(res.cpus, res.gpus, nodes):
                reason = (
                    "; ".join(f"{f}: {m}" for f, m in problems)
                    + ". Ray keeps the trials queued until such a node joins; cancel the study"
                    " or add one."
                )
        if reason == self._reason:
            return
        self._reason = reason
        log.warning("study %d: %s", self.study_id, reason or "trials are starting again")

        self.studies.set_waiting_reason(self.study_id, reason, queued)
