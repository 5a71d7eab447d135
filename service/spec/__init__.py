"""StudySpec: what a user POSTs to start a study (JSON or YAML).

A spec is a base trial config, a search space over dotted fields of that
config, a sampler/pruner, a budget and the objectives and constraints that
define a *stable* setting. Validation happens completely before anything is
written: every error carries the dotted path of the field.

This module is the one name to import them by. The model and what it checks on its own
are in service/spec/model.py; the checks that need more (parsing a body, every point of
the search space in service/spec/space.py, the deployment's limits, the data directory) in
service/spec/checks.py.
"""

from __future__ import annotations

from service.spec.checks import (
    DATA_DIR_RULE,
    FILE_RULE,
    MAX_DATA_CHECKS,
    MAX_NESTING,
    check_data_dirs,
    check_data_files,
    check_limits,
    parse_spec,
)
from service.spec.model import (
    HISTORY_FREE_SAMPLERS,
    INFEASIBLE_PATIENCE,
    MAX_FUSE,
    SUMMARY_METRICS,
    Budget,
    CategoricalParam,
    Constraint,
    FixedParam,
    FloatParam,
    IntParam,
    Objective,
    Param,
    PrunerSpec,
    Resources,
    SamplerSpec,
    Scalar,
    SpecError,
    StabilitySpec,
    StudySpec,
    SummaryMetric,
    apply_params,
    count_params,
    resolve_task,
    summary_value,
    vocab_size,
    with_params,
)

__all__ = [
    "DATA_DIR_RULE",
    "FILE_RULE",
    "HISTORY_FREE_SAMPLERS",
    "INFEASIBLE_PATIENCE",
    "MAX_DATA_CHECKS",
    "MAX_FUSE",
    "MAX_NESTING",
    "SUMMARY_METRICS",
    "Budget",
    "CategoricalParam",
    "Constraint",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "Objective",
    "Param",
    "PrunerSpec",
    "Resources",
    "SamplerSpec",
    "Scalar",
    "SpecError",
    "StabilitySpec",
    "StudySpec",
    "SummaryMetric",
    "apply_params",
    "resolve_task",
    "check_data_dirs",
    "check_data_files",
    "check_limits",
    "count_params",
    "parse_spec",
    "summary_value",
    "vocab_size",
    "with_params",
]
