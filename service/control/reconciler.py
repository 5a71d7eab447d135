"""The API process's background control loop: the Ray job client, connected lazily, and the
reconciler that launches PENDING studies and relaunches RUNNING ones whose job died, then
keeps the standby runners (service/control/standby.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.control.launch import reconcile
from service.control.ray_cluster import JobLauncher
from service.control.standby import keep_standbys
from service.store import Store

__all__ = ["LauncherSlot", "reconcile_forever"]

log = logging.getLogger("qkscope.app")


class LauncherSlot:
    """Connects to Ray's job server on first use; retries at most every few seconds."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._launcher: JobLauncher | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> JobLauncher | None:
        if not self.address:
            return None
        with self._lock:
            if self._launcher is None and time.monotonic() >= self._next_try:
                try:
                    self._launcher = JobLauncher(self.address)
                except Exception as e:
                    log.warning("Ray job server at %s unreachable: %s", self.address, e)
                    self._next_try = time.monotonic() + 5.0
            return self._launcher


async def reconcile_forever(
    store: Store, slot: LauncherSlot, settings: Settings, rounds: Any
) -> None:
    """Every `reconcile_interval_s`: launch PENDING studies and relaunch RUNNING ones whose
    Ray job died; say on live studies when Ray's job server does not answer. `rounds`
    (a Prometheus counter) counts the rounds: observable proof the loop runs."""
    while True:
        launcher = await run_in_threadpool(slot)
        if launcher is None and settings.ray_address:
            try:  # no job client yet: Ray's job server has not answered since we started
                await run_in_threadpool(
                    store.studies.mark_ray_unreachable, settings.ray_address, "no connection"
                )
            except Exception:
                log.exception("marking studies as waiting for Ray failed")
        if launcher is not None:
            try:
                await run_in_threadpool(reconcile, store, launcher, settings)
            except Exception:
                log.exception("reconcile failed")
            try:
                await run_in_threadpool(keep_standbys, store, launcher, settings)
            except Exception:
                log.exception("keeping standby runners failed")
        rounds.inc()
        await asyncio.sleep(settings.reconcile_interval_s)
