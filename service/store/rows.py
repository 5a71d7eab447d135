"""The one shape of a store write: a whole transaction, fenced, retried.

`Rows._tx` is what `StudyRows` and `TrialRows` wrap their SQL in: one transaction
(`session_scope`), whose first statement is the runner's fence check (`check_fence`; a
no-op without a fence), run again by `with_retry` after a dropped connection or a locked
database. Each method gives only its SQL, as a function of the session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

from service.store.fence import Fence, check_fence
from service.store.session import session_scope, with_retry

__all__ = ["Rows"]

T = TypeVar("T")


class Rows:
    """A writer of some of the store's tables: its sessions and (a runner's) fence."""

    def __init__(self, sessions: sessionmaker[Session], fence: Fence | None = None) -> None:
        self.sessions = sessions
        self.fence = fence

    def _tx(self, work: Callable[[Session], T], what: str, *, fenced: bool = True) -> T:
        """`work(session)` in one transaction, retried as one unit (`with_retry`, its log
        and `DatabaseUnavailable` labelled `what`); with `fenced`, the transaction starts
        with `check_fence` (`Superseded`, nothing written, when the fence is stale)."""

        def once() -> T:
            with session_scope(self.sessions) as s:
                if fenced:
                    check_fence(s, self.fence)
                return work(s)

        return with_retry(once, what)
