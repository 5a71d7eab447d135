"""The two errors the client raises: the API said no (`ApiError`), or there is no API to ask
(`ConnectError`). Both print as one line a person can act on."""

from __future__ import annotations

from typing import Any

__all__ = ["ApiError", "ConnectError", "QkscopeError"]

CONNECT_HINT = "start it with `qkscope serve`, or point QKSCOPE_API_URL at a running service"


class QkscopeError(Exception):
    """Base class of the client's errors."""


class ApiError(QkscopeError):
    """A 4xx/5xx answer: `status`, the API's error `code`, its `message`, and `field` (the
    first field the API named, e.g. `budget.n_trials`), with every named field in `errors`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "error",
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.errors = errors or []
        self.field: str | None = self.errors[0].get("field") if self.errors else None
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f" [{self.field}]" if self.field else ""
        return f"HTTP {self.status} {self.code}{where}: {self.message}"


class ConnectError(QkscopeError):
    """The service could not be reached at `url`; `hint` says what to do about it."""

    def __init__(self, url: str, reason: str, hint: str = CONNECT_HINT) -> None:
        self.url = url
        self.reason = reason
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"cannot reach the qkscope API at {self.url} ({self.reason}); {self.hint}"
