"""A standby runner: the runner job of a study nobody has submitted yet, warm and waiting.

The service keeps a standby (service/control/standby.py) so that a POST finds a runner
already up: its driver started, Ray initialised, Optuna's storage open, its inbox actor
alive and worker processes that have imported torch and trained a tiny model
(workers/warmup.py). A POST claims the standby's row (service/store/standbys.py); the
runner sees the claim within `POLL_S` and runs the study with what it prepared. Until then
it says every `HEARTBEAT_S` that it is alive, which is what makes it claimable.

It is the entrypoint of any other runner job (`python -m service.runner <id> <attempt>`): a
runner finds out that it is a standby from its row.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import optuna
import ray

from service.config import Settings
from service.runner.pool import make_inbox
from service.store import (
    HEARTBEAT_S,
    STANDBY,
    Store,
    Waiting,
    optuna_storage,
    with_retry,
)
from workers.warmup import warm_worker

__all__ = ["POLL_S", "Warm", "is_standby", "stand_by"]

log = logging.getLogger("qkscope.runner")
POLL_S = 0.05  # how often a standby looks for its claim: the most it adds to a POST
# The inbox a standby makes serves studies of up to this parallelism (an async actor: the
# bound is a count of calls, not threads); a study of more gets a new one.
INBOX_WORKERS = 16
_warm_task: Any = ray.remote(warm_worker)


@dataclass
class Warm:
    """What a standby prepared for the study that claims it; the runner takes it over."""

    storage: optuna.storages.RDBStorage
    inbox: Any  # a TrialInboxActor handle
    inbox_workers: int  # the parallelism the inbox was made for (service/runner/pool.py)
    pids: list[int] = field(default_factory=list)  # the worker processes warmed


def is_standby(study_id: int, store: Store) -> bool:
    """Whether the study's row is a standby (read once; a row that is gone is not)."""
    row = with_retry(lambda: store.studies.get(study_id), "read study row")
    return row is not None and row.status == STANDBY


def stand_by(study_id: int, settings: Settings, store: Store) -> Warm | None:
    """Prepare, then wait until a POST claims the row `study_id`: returns what was prepared
    (the runner then runs the study), or None when the row was retired (the job exits).
    `store` is unfenced: the standby writes only its own heartbeat."""
    t0 = time.monotonic()
    warm = _prepare(settings)
    log.info(
        "standby %d: warm in %.1f s (%d worker processes: %s); waiting for a study",
        study_id,
        time.monotonic() - t0,
        len(set(warm.pids)),
        sorted(set(warm.pids)),
    )
    next_beat = 0.0
    while True:
        now = time.monotonic()
        beat = now >= next_beat
        state = store.standbys.look(study_id, heartbeat=beat)
        if beat:
            next_beat = now + HEARTBEAT_S
        if state is Waiting.CLAIMED:
            log.info("standby %d: claimed; running the study", study_id)
            return warm
        if state is Waiting.GONE:
            log.info("standby %d: retired; exiting", study_id)
            warm.storage.engine.dispose()
            ray.kill(warm.inbox)
            return None
        time.sleep(POLL_S)


def _prepare(settings: Settings) -> Warm:
    """Optuna's storage, the inbox actor (first: an actor takes a worker process of its own,
    which must not be one that was warmed for trials) and the warmed worker processes."""
    storage = optuna_storage(settings.resolved_database_url())
    inbox = make_inbox(INBOX_WORKERS, settings.inbox_max_messages)
    ray.get(inbox.__ray_ready__.remote())  # alive before the warm-ups ask for processes
    cpus = int(ray.available_resources().get("CPU", 1))  # type: ignore[no-untyped-call]
    n = max(1, min(settings.standby_workers, cpus))
    # Sent together and lingering a little, so that each lands in a process of its own.
    pids = ray.get([_warm_task.options(num_cpus=1).remote(0.3) for _ in range(n)])
    return Warm(storage, inbox, INBOX_WORKERS, list(pids))
