"""The metric registry (workers.metric_names) against what the workers really produce:
it imports no torch, its summaries are the TrialSummary's metric fields with the same
types, and its series are exactly the names (and layer/head indexing) a real trial emits."""

from __future__ import annotations

import subprocess
import sys
import typing
from typing import Any

from tests.conftest import ROOT
from tests.workers.helpers import Recorder, tiny
from workers.metric_names import (
    FLAG_SUMMARIES,
    INTERMEDIATE_SUMMARIES,
    NUMERIC_SUMMARIES,
    OBJECTIVE_SUMMARIES,
    SERIES,
    SERIES_NAMES,
    SUMMARIES,
    SUMMARY_NAMES,
)
from workers.trial import TrialSummary, run_trial

# TrialSummary fields that are bookkeeping or raw curves, not metrics of METRICS.md.
NOT_METRICS = {
    "status",
    "stop_reason",
    "steps_done",
    "plateaus",
    "diverged_at_step",
    "eval_steps",
    "val_losses",
    "wall_time_s",
    "tokens_per_s",
    "device",
    "config_hash",
    "code_commit",
}


def test_registry_imports_no_torch() -> None:
    code = (
        "import sys, workers.metric_names as r; "
        "assert r.SERIES and r.SUMMARIES; "
        "heavy = [m for m in ('torch', 'ray', 'optuna', 'sqlalchemy') if m in sys.modules]; "
        "print(heavy); assert not heavy, heavy"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert out.stdout.strip() == "[]"


def test_names_are_unique_and_every_entry_says_what_it_means() -> None:
    assert len(set(SERIES_NAMES)) == len(SERIES_NAMES)
    assert len(set(SUMMARY_NAMES)) == len(SUMMARY_NAMES)
    for m in (*SERIES, *SUMMARIES):
        assert m.meaning and "\n" not in m.meaning and len(m.meaning) <= 100, m
    for s in SUMMARIES:
        # a summary is made from a series, or (a threshold flag) from another summary
        source_kind = SUMMARY_NAMES if s.over == "threshold" else SERIES_NAMES
        assert s.source in source_kind, s
        assert s.aggregate.startswith(s.over)
    assert set(INTERMEDIATE_SUMMARIES) <= set(NUMERIC_SUMMARIES)
    assert set(OBJECTIVE_SUMMARIES) <= set(NUMERIC_SUMMARIES)
    assert set(NUMERIC_SUMMARIES) | set(FLAG_SUMMARIES) == set(SUMMARY_NAMES)


def _python_type(annotation: Any) -> set[type]:
    args = typing.get_args(annotation) or (annotation,)
    return {a for a in args if a is not type(None)}


def test_summaries_are_exactly_the_trial_summary_metric_fields() -> None:
    fields = TrialSummary.model_fields
    assert set(SUMMARY_NAMES) == set(fields) - NOT_METRICS
    want = {"float": {float}, "int": {int}, "bool": {bool}}
    for s in SUMMARIES:
        assert _python_type(fields[s.name].annotation) == want[s.type], s.name


def test_series_are_exactly_what_a_real_trial_emits() -> None:
    """A real trial with a regularizer and eval_at_init: every name, with its indexing."""
    rec = Recorder()
    config = tiny(steps=10, eval_at_init=True, regularizer={"kind": "locater", "lambda": 0.01})
    run_trial(config, rec)
    emitted: dict[str, set[tuple[bool, bool]]] = {}
    for _step, points in rec.reports:
        for p in points:
            emitted.setdefault(p.name, set()).add((p.layer is not None, p.head is not None))
    assert set(emitted) == set(SERIES_NAMES)
    index = {"none": (False, False), "layer": (True, False), "head": (True, True)}
    for s in SERIES:
        assert emitted[s.name] == {index[s.index]}, s.name
