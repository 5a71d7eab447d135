"""Keeps the embedded Ray head of `qkscope serve` alive.

Without it, a head that died under a running `serve` (its GCS killed, the OOM killer, a
`ray stop` in another terminal) left an API that answered 2xx to every POST while no study
could ever start. The watchdog checks the head every few seconds; when it has died, it says
so on stderr and starts a new one on the same ports (the API's job client reconnects by
URL, and the reconciler resubmits the studies whose runner jobs died with the old head).
After `max_failures` restarts in a row that fail, it gives up loudly: `on_give_up` is told
why, and `serve` exits non-zero instead of serving a service that cannot run anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from service.control.ray_cluster import LocalRayHead

__all__ = ["HeadWatchdog"]

log = logging.getLogger(__name__)


class HeadWatchdog(threading.Thread):
    """A daemon thread that restarts `head` when it dies (see the module docstring)."""

    def __init__(
        self,
        head: LocalRayHead,
        interval_s: float,
        say: Callable[[str], None],
        on_give_up: Callable[[str], None],
        max_failures: int = 3,
    ) -> None:
        super().__init__(name="qkscope-ray-head-watchdog", daemon=True)
        self.head = head
        self.interval_s = interval_s
        self.say = say
        self.on_give_up = on_give_up
        self.max_failures = max_failures
        self.restarts = 0
        self._closing = threading.Event()
        self._busy = threading.Lock()  # held while a restart runs; close() waits for it

    def run(self) -> None:
        failures = 0
        while not self._closing.wait(self.interval_s):
            with self._busy:
                if self._closing.is_set() or self.head.alive():
                    failures = 0
                    continue
                self.say(f"the local Ray head (pid {self.head.pid}) died; restarting it ...")
                try:
                    url = self.head.restart()
                except Exception as e:  # noqa: BLE001 - any failure counts, the log says why
                    failures += 1
                    self.say(f"restarting the local Ray head failed ({failures}): {e}")
                    if failures >= self.max_failures:
                        self.on_give_up(
                            f"the local Ray head died and {failures} restarts failed ({e}); "
                            f"see {self.head.home / 'logs' / 'ray-head.log'}"
                        )
                        return
                    continue
                failures = 0
                self.restarts += 1
                self.say(f"restarted the local Ray head (pid {self.head.pid}, dashboard {url})")

    def close(self, timeout_s: float = 150.0) -> None:
        """Stop watching (after a restart in progress has finished)."""
        self._closing.set()
        if self.is_alive():
            self.join(timeout_s)
