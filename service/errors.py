"""The one error for a bad input that names its field: a spec field, a query parameter.

Raised wherever the check is (service/spec*.py, service/read/...), it stays free of HTTP:
the API turns it into a 422 `{error: "validation_error", message: "<field>: <message>",
errors: [{field, message}]}` in one exception handler (service/api/errors.py). The older
names (`SpecError`, `QueryError`, `PlotError`, `ImportanceError`, `LrSensitivityError`)
are this class under the name their module exports.
"""

from __future__ import annotations

__all__ = ["InvalidField"]


class InvalidField(ValueError):
    """A bad value, with the (dotted) field or query parameter it concerns."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message
