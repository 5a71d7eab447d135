"""How many studies may be live at once: a POST past the cap is a 429 with Retry-After.

Each live study costs the Ray head memory whatever its trials do: its runner job's driver,
the job supervisor actor and the inbox actor, all at `num_cpus=0` on the head (about 410 MB
a study measured; docs/operations.md, "Live studies"). Nothing bounded them, and about 50
POSTs ran a 23 GB head out of memory (issue 42). Two settings bound them:

- `QKSCOPE_MAX_LIVE_STUDIES`: studies PENDING or RUNNING at once;
- `QKSCOPE_HEAD_MEMORY_BYTES` / `QKSCOPE_HEAD_BYTES_PER_STUDY`: the head memory live studies
  may take, and what one takes (0: no memory bound); the cap is then the smaller of the two.

A POST past the cap is refused (429, `Retry-After`, the reason, nothing written) rather than
queued PENDING: a queued study would need the reconciler to hold back launches and to
choose which waiting study goes next, and a client that retries after `Retry-After` gets
the same effect with no state on the server; the idempotency key makes its retry safe. A
POST that repeats an idempotency key whose study exists is answered as before (200), cap or
not. The count and the insert are one step under a lock of this process, so concurrent
POSTs to one API process never pass the cap together (several API processes may pass it by
the POSTs in flight at once).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service.api.errors import ApiError
from service.config import Settings
from service.store import Study, StudyStatus, session_scope

__all__ = ["RETRY_AFTER_S", "admit", "live_cap"]

LIVE = (StudyStatus.PENDING, StudyStatus.RUNNING)

RETRY_AFTER_S = 30  # what a 429 asks a client to wait: about a small study's time to finish

_lock = threading.Lock()


def live_cap(settings: Settings) -> tuple[int, str]:
    """The live studies the settings allow, and the setting that sets it."""
    cap, why = settings.max_live_studies, "QKSCOPE_MAX_LIVE_STUDIES"
    if settings.head_memory_bytes > 0:
        by_memory = settings.head_memory_bytes // settings.head_bytes_per_study
        if by_memory < cap:
            cap = by_memory
            why = (
                f"QKSCOPE_HEAD_MEMORY_BYTES {settings.head_memory_bytes / 2**30:.1f} GiB at"
                f" QKSCOPE_HEAD_BYTES_PER_STUDY {settings.head_bytes_per_study / 2**20:.0f} MiB"
                " a study"
            )
    return cap, why


def _live(sessions: sessionmaker[Session]) -> int:
    with session_scope(sessions) as s:
        n = s.scalar(select(func.count()).select_from(Study).where(Study.status.in_(LIVE)))
    return int(n or 0)


def _known(sessions: sessionmaker[Session], idempotency_key: str) -> bool:
    with session_scope(sessions) as s:
        found = s.scalar(select(Study.id).where(Study.idempotency_key == idempotency_key))
    return found is not None


@contextlib.contextmanager
def admit(
    sessions: sessionmaker[Session], settings: Settings, idempotency_key: str | None
) -> Iterator[None]:
    """Hold the admission lock while the caller inserts the study; raise the 429 when the
    live studies are at the cap already (not for a repeated idempotency key)."""
    with _lock:
        if idempotency_key is None or not _known(sessions, idempotency_key):
            live = _live(sessions)
            cap, why = live_cap(settings)
            if live >= cap:
                raise ApiError(
                    429,
                    "too_many_live_studies",
                    f"{live} studies are live (PENDING or RUNNING), the most {why} allows"
                    f" ({cap}); each costs the Ray head memory while it runs: retry after"
                    f" {RETRY_AFTER_S} s or once a study ends",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
        yield
