"""A pruner's stop reaches the trial between evaluations (workers/inbox.py): a report that
carries a value asks the inbox for the runner's verdict; `InboxReporter.poll` reads it
without waiting, so the stop is heard with no further report. Real Ray, a real inbox actor,
the runner's side played by its own calls (`stop`, `judged`)."""

from __future__ import annotations

import time
from typing import Any

import ray

from workers.config import MetricPoint
from workers.inbox import InboxReporter, TrialInboxActor


def _poll_until(reporter: InboxReporter, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (reason := reporter.poll()) is not None:
            return reason
        time.sleep(0.01)
    return None


def _report(reporter: InboxReporter, step: int, value: float | None) -> str | None:
    return reporter.report(step, [MetricPoint("val_loss", 1.0)], value)


def test_a_stop_is_heard_between_reports(local_ray: None) -> None:
    inbox: Any = TrialInboxActor.remote()
    reporter = InboxReporter(inbox, trial=7)
    assert _report(reporter, 10, 2.5) is None
    assert _poll_until(reporter, 0.3) is None  # not judged yet: nothing to hear
    ray.get(inbox.stop.remote(7, "median pruner: final_val_loss 2.5 at step 10"))
    ray.get(inbox.judged.remote({7: 10}))
    assert _poll_until(reporter, 10) == "median pruner: final_val_loss 2.5 at step 10"


def test_a_judged_report_that_goes_on_frees_the_verdict_for_the_next(local_ray: None) -> None:
    inbox: Any = TrialInboxActor.remote()
    reporter = InboxReporter(inbox, trial=3)
    _report(reporter, 10, 2.5)
    first = reporter._verdict
    assert first is not None
    ray.get(inbox.judged.remote({3: 10}))  # judged: go on
    assert first.result(timeout=10) is None
    assert reporter.poll() is None and reporter._verdict is None
    _report(reporter, 20, 2.4)  # the next report asks again
    assert reporter._verdict is not None and reporter._verdict is not first
    ray.get(inbox.stop.remote(3, "pruned at 20"))
    assert _poll_until(reporter, 10) == "pruned at 20"


def test_other_trials_verdicts_and_reports_without_a_value(local_ray: None) -> None:
    inbox: Any = TrialInboxActor.remote()
    quiet = InboxReporter(inbox, trial=1)
    _report(quiet, 10, None)  # no value: nothing for the pruner, no verdict asked
    assert quiet._verdict is None
    other = InboxReporter(inbox, trial=2)
    _report(other, 10, 1.0)
    ray.get(inbox.stop.remote(1, "trial 1 only"))
    ray.get(inbox.judged.remote({2: 10}))
    assert other._verdict is not None and other._verdict.result(timeout=10) is None
    assert _poll_until(other, 0.3) is None  # trial 1's stop is not trial 2's


def test_a_verdict_not_given_in_time_is_none(local_ray: None) -> None:
    inbox: Any = TrialInboxActor.remote()
    t0 = time.monotonic()
    assert ray.get(inbox.verdict.remote(5, 10, 0.2)) is None
    assert time.monotonic() - t0 < 5
    ray.get(inbox.judged.remote({5: 9}))  # an older step judged: not this one
    assert ray.get(inbox.verdict.remote(5, 10, 0.2)) is None
    ray.get(inbox.judged.remote({5: 10}))
    assert ray.get(inbox.verdict.remote(5, 10, 0.2)) is None  # judged, and not stopped
    ray.get(inbox.stop.remote(5, "stop"))
    assert ray.get(inbox.verdict.remote(5, 30, 0.2)) == "stop"  # a stop answers any step
