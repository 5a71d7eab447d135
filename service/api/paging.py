"""Cursors for the metric routes: where the next page of a trial's metric rows starts.

A cursor is opaque to clients: base64url of the JSON key `[name, layer, head, step]` of the
first row of the next page (layer/head as stored). Paging by key (not by offset) reads only
the page's rows from the primary-key index however deep the page, in short transactions, and
a row written while a client pages never makes it skip or repeat one.
"""

from __future__ import annotations

import base64
import binascii
import json
import re

from service.api.errors import ApiError
from service.api.schemas import FieldError
from service.read.queries import MetricKey

__all__ = ["decode_cursor", "encode_cursor"]

_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
_INT = 2**31


def encode_cursor(key: MetricKey) -> str:
    raw = json.dumps(list(key), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(text: str | None) -> MetricKey | None:
    """The key a cursor stands for (none given or empty: the first page); a 422 naming
    `cursor` for anything this API did not give."""
    if not text:
        return None
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        key = json.loads(raw)
        name, layer, head, step = key
        ok = isinstance(name, str) and _NAME.fullmatch(name) is not None
        ok = ok and all(
            isinstance(v, int) and not isinstance(v, bool) and -_INT <= v < _INT
            for v in (layer, head, step)
        )
        if ok:
            return (name, layer, head, step)
    except (binascii.Error, ValueError, TypeError):
        pass
    raise ApiError(
        422,
        "validation_error",
        "cursor: not a cursor of this route (use the one the last page gave)",
        [FieldError(field="cursor", message="not a cursor of this route")],
    )
