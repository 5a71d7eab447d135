"""Infinities in JSON: the one form a trial's summary and every API response give them.

A running maximum of docs/metrics.md section 9 (`max_attn_logit_ever`,
`max_abs_output_log_z_ever`) is `+inf` once a value overflowed. JSON has no infinity:
PostgreSQL's `json` type rejects Python's `Infinity` token, and a JSON response refuses it.
So wherever a summary or a response is JSON, an infinity is the string `"inf"` (`"-inf"`
below zero), which `float()` and pydantic read back as the float (optuna-dashboard's JSON
uses the same strings for infinite values); NaN is `null` (a value that is not a number is
no value). In Python (the service's reads, the runner) a summary
always holds the float: `SummaryJSON` writes the strings into the summary column and reads
them back as floats; a number a read extracts from the summary JSON by itself goes through
`json_number`. Float columns hold the real infinity (SQLite and PostgreSQL both can).
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import JSON
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

__all__ = ["INF", "NEG_INF", "SummaryJSON", "decode_numbers", "json_number", "jsonable"]

INF, NEG_INF = "inf", "-inf"
_FLOATS = {INF: math.inf, NEG_INF: -math.inf}


def jsonable(value: Any) -> Any:
    """`value` with every infinity as `"inf"`/`"-inf"` and every NaN as None, at any depth
    of dicts, lists and tuples (tuples become lists, as JSON has them)."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return INF if value > 0 else NEG_INF
        return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def json_number(value: Any) -> Any:
    """A value read from JSON, with `"inf"`/`"-inf"` as the float; anything else as it is."""
    if isinstance(value, str):
        return _FLOATS.get(value, value)
    return value


def decode_numbers(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """A summary read from JSON with its infinities as floats (its top-level numbers: where
    the summary metrics are)."""
    if summary is None:
        return None
    return {k: json_number(v) for k, v in summary.items()}


class SummaryJSON(TypeDecorator[Any]):
    """JSON whose infinities are stored as `"inf"`/`"-inf"` (`jsonable`) and read back as
    floats (`decode_numbers`): the trial summary's column. Indexing (`Trial.summary[k]`)
    works as on JSON; a number extracted in SQL reads `"inf"` as the database says (a cast
    to float on PostgreSQL: Infinity; SQLite compares the text above every number)."""

    impl = JSON
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        return jsonable(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return decode_numbers(value) if isinstance(value, dict) else value
