"""Issue 32, item 2: the inbox had no backpressure. Workers' messages piled up in it for as
long as the runner was slower than they were (a slow database), without bound. Now it holds
at most `max_messages`; a full inbox makes the workers' next message wait. Real Ray: two
fast producers (real `InboxReporter`s in Ray tasks), one slow consumer reading the runner's
stream; the bound held (seen by the consumer and by the inbox), the producers were made to
wait, and every message arrived exactly once."""

from __future__ import annotations

import time
from typing import Any

import ray

from workers.config import MetricPoint
from workers.inbox import IN_FLIGHT, STREAM_AHEAD, TrialInboxActor, max_concurrency

BOUND = 5
REPORTS = 40  # per producer
TRIALS = (3, 8)


def _producer() -> Any:
    """A Ray task that reports as fast as it can (made here, so Ray ships it by value)."""

    def produce(inbox: Any, trial: int, n: int) -> float:
        from workers.inbox import InboxReporter

        reporter = InboxReporter(inbox, trial)
        t0 = time.monotonic()
        for step in range(n):
            reporter.report(step, [MetricPoint("val_loss", float(step))], None)
        reporter.flush()
        return time.monotonic() - t0

    return ray.remote(num_cpus=0)(produce)


def test_a_full_inbox_makes_workers_wait_and_loses_nothing(local_ray: None) -> None:
    inbox: Any = TrialInboxActor.options(max_concurrency=max_concurrency(2, 1)).remote(BOUND)
    stream = inbox.stream.options(
        num_returns="streaming", _generator_backpressure_num_objects=STREAM_AHEAD
    ).remote()
    producers = [_producer().remote(inbox, t, REPORTS) for t in TRIALS]
    received: dict[int, list[int]] = {t: [] for t in TRIALS}
    sizes: list[int] = []
    held_most = waiting_most = 0

    def take(timeout: float) -> bool:
        if not ray.wait([stream], num_returns=1, timeout=timeout)[0]:
            return False
        try:
            batch = ray.get(next(stream))
        except StopIteration:
            return False
        sizes.append(len(batch.reports) + len(batch.starts) + len(batch.ends))
        for r in batch.reports:
            received[r.trial].append(r.step)
        return True

    deadline = time.monotonic() + 120
    while ray.wait(producers, num_returns=len(producers), timeout=0)[1]:
        assert time.monotonic() < deadline, "the producers never finished"
        held, high, bound, waiting = ray.get(inbox.stats.remote())
        held_most, waiting_most = max(held_most, high), max(waiting_most, waiting)
        take(timeout=1.0)
        time.sleep(0.1)  # a slow runner: a database write per batch
    ray.get(producers)
    # When a producer's last message was taken in, the runner had read all but what the
    # inbox and the stream may hold: without backpressure the producers finish at once and
    # nearly everything is still unread (it waited in Ray's object store, without bound).
    unread = len(TRIALS) * REPORTS - sum(map(len, received.values()))
    assert unread <= (STREAM_AHEAD + 2) * BOUND, unread
    inbox.close.remote()
    while take(timeout=10.0):
        pass
    held, high, bound, waiting = ray.get(inbox.stats.remote())
    assert bound == BOUND
    # The bound held, seen by the consumer (each batch) and by the inbox (its high water).
    assert max(sizes) <= BOUND, sizes
    assert max(held_most, high) <= BOUND
    # The producers were made to wait, and no more than their in-flight reports each.
    assert waiting_most > 0, "the inbox never was full: no backpressure was exercised"
    assert waiting_most <= len(TRIALS) * IN_FLIGHT
    # Every message arrived exactly once (an async actor runs calls concurrently, so their
    # order is not promised, with or without backpressure: the runner keys rows by step).
    for t in TRIALS:
        assert sorted(received[t]) == list(range(REPORTS)), (t, received[t])
