"""Prometheus metrics, read from the database at scrape time.

Nothing is counted in the API process: every scrape asks the database, so the numbers
are right across API restarts, several API replicas, and the runner processes (Ray
jobs) that write trials. Exposed at `GET /metrics` (bearer token, like the API).

- `qkscope_studies{status}`: studies by status (gauge; every status, zeros included)
- `qkscope_trials{state}`: trials by state (gauge; every state, zeros included)
- `qkscope_trial_duration_seconds{state}`: histogram of `qk_trial.duration_s` of
  finished trials (every state but QUEUED and RUNNING, trials with a duration)
- `qkscope_metric_rows_written_total`: metric rows stored by finished trials (counter:
  the sum of `qk_trial.metric_rows`, which the runner sets when a trial finishes)
- `qkscope_standby_runners{state}`: standby runners (service/control/standby.py), `ready`
  (warm and claimable: a fresh heartbeat) or `starting` (gauge)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.store import (
    OPEN_TRIAL_STATES,
    STANDBY,
    STANDBY_STALE_S,
    Study,
    StudyStatus,
    Trial,
    TrialState,
    session_scope,
    utcnow,
)

__all__ = [
    "DURATION_BUCKETS",
    "DatabaseCollector",
    "exposition",
    "make_registry",
    "reconcile_counter",
]

# Trials run from seconds (a smoke test) to hours (a language model on a GPU).
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
                    14400.0, 43200.0, 86400.0, math.inf)  # fmt: skip
FINISHED = [s.value for s in TrialState if s not in OPEN_TRIAL_STATES]


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


class DatabaseCollector:
    """A prometheus_client collector that queries qkscope's tables on every collect()."""

    def __init__(self, sessions: Callable[[], sessionmaker[Session]]) -> None:
        self._sessions = sessions  # resolved at scrape time: the app makes it in lifespan

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                 CounterMetricFamily, GaugeMetricFamily]:  # fmt: skip
        return (
            GaugeMetricFamily("qkscope_studies", "Studies by status.", labels=["status"]),
            GaugeMetricFamily("qkscope_trials", "Trials by state.", labels=["state"]),
            HistogramMetricFamily(
                "qkscope_trial_duration_seconds",
                "Wall time of finished trials (qk_trial.duration_s), by final state.",
                labels=["state"],
            ),
            CounterMetricFamily(
                "qkscope_metric_rows_written",
                "Metric rows stored by finished trials (sum of qk_trial.metric_rows).",
            ),
            GaugeMetricFamily(
                "qkscope_standby_runners",
                "Standby runner jobs: ready (warm, claimable by the next POST) or starting.",
                labels=["state"],
            ),
        )

    def describe(self) -> Iterable[Metric]:
        """The families without samples: registering the collector reads no database."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        studies, trials, durations, rows, standbys = self._families()
        with session_scope(self._sessions()) as s:
            by_status = dict(
                s.execute(select(Study.status, func.count()).group_by(Study.status)).all()
            )
            by_state = dict(
                s.execute(select(Trial.state, func.count()).group_by(Trial.state)).all()
            )
            cols: list[Any] = [Trial.state, func.count(), func.sum(Trial.duration_s)]
            cols += [
                func.sum(case((Trial.duration_s <= b, 1), else_=0))
                for b in DURATION_BUCKETS
                if not math.isinf(b)
            ]
            hist = {
                r[0]: r[1:]
                for r in s.execute(
                    select(*cols)
                    .where(Trial.state.in_(FINISHED), Trial.duration_s.is_not(None))
                    .group_by(Trial.state)
                ).all()
            }
            written = s.scalar(select(func.coalesce(func.sum(Trial.metric_rows), 0)))
            fresh = utcnow() - timedelta(seconds=STANDBY_STALE_S)
            ready = func.sum(case((Study.started_at >= fresh, 1), else_=0))
            n_standby, n_ready = s.execute(
                select(func.count(), ready).where(Study.status == STANDBY)
            ).one()
        for st in StudyStatus:
            studies.add_metric([st.value], float(by_status.get(st.value, 0)))
        for ts in TrialState:
            trials.add_metric([ts.value], float(by_state.get(ts.value, 0)))
        for state in FINISHED:
            count, total, *cum = hist.get(state, (0, None, *([0] * (len(DURATION_BUCKETS) - 1))))
            buckets = [(_le(b), float(c or 0)) for b, c in zip(DURATION_BUCKETS, cum, strict=False)]
            buckets.append(("+Inf", float(count or 0)))
            durations.add_metric([state], buckets, sum_value=float(total or 0.0))
        rows.add_metric([], float(written or 0))
        standbys.add_metric(["ready"], float(n_ready or 0))
        standbys.add_metric(["starting"], float((n_standby or 0) - (n_ready or 0)))
        return [studies, trials, durations, rows, standbys]


def make_registry(sessions: Callable[[], sessionmaker[Session]]) -> CollectorRegistry:
    """A registry of its own per app (the global one would be shared by every app in a
    process, and its process metrics describe the API process only)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(sessions))
    return registry


def reconcile_counter(registry: CollectorRegistry) -> Counter:
    """Rounds of this API process's reconciler (process-local: each API process counts its
    own), so operators and tests can see that the loop runs."""
    return Counter(
        "qkscope_reconcile_rounds",
        "Rounds of the reconciler loop completed by this API process.",
        registry=registry,
    )


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The scrape body and its content type (Prometheus text, or OpenMetrics if asked)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
