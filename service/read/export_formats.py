"""How the export's tables are written: CSV (with OWASP's CSV-injection defence) and
Parquet, batch by batch into a write-only sink the stream drains (service/read/export.py
reads the rows)."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "FORMULA_STARTS",
    "Batches",
    "Counting",
    "Sink",
    "Table",
    "neutralise",
    "write_csv",
    "write_parquet",
]

Batches = Callable[[], Iterator[list[list[Any]]]]


@dataclass(frozen=True)
class Table:
    name: str
    columns: list[tuple[str, str]]
    batches: Batches  # rows, a batch at a time, each read in its own short transaction


class Sink:
    """A write-only, non-seekable byte sink that the stream drains after every batch."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._pos = 0
        self.closed = False

    def write(self, b: bytes | bytearray | memoryview) -> int:
        data = bytes(b)
        self._chunks.append(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def drain(self) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


class Counting:
    """Adds tell() to a write-only file (a zip member) for pyarrow's Parquet writer."""

    def __init__(self, f: Any) -> None:
        self._f, self._pos, self.closed = f, 0, False

    def write(self, b: bytes | bytearray | memoryview) -> int:
        n: int = self._f.write(b)
        self._pos += len(b)
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self.closed = True  # the zip member is closed by its owner

    def writable(self) -> bool:
        return True


# A spreadsheet reads a cell that starts with one of these as a formula (CSV injection).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# A plain number literal (a negative number is not a formula): left as it is.
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def neutralise(text: str) -> str:
    """OWASP's CSV-injection defence: a string cell that a spreadsheet would run as a formula
    (it starts with =, +, -, @, a tab or a carriage return) gets a leading single quote, so
    it is shown as text; the csv writer quotes it where needed. Number literals ("-3",
    "+1.5e-3") are left alone, so they stay numbers."""
    if text.startswith(FORMULA_STARTS) and not _NUMBER.fullmatch(text):
        return "'" + text
    return text


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, str):
        return neutralise(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, datetime):
        return (v if v.tzinfo else v.replace(tzinfo=UTC)).isoformat()
    if isinstance(v, float):
        return repr(v)  # shortest text that reads back as the same float
    return v


def write_csv(table: Table, out: Any) -> Iterator[None]:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    # The csv module quotes a field holding "\n" (the line terminator) but not a bare "\r",
    # which readers take for a line end: a row with one is written fully quoted.
    quoted = csv.writer(text, lineterminator="\n", quoting=csv.QUOTE_ALL)
    writer.writerow([c for c, _ in table.columns])
    for rows in table.batches():
        for r in rows:
            cells = [_csv_cell(v) for v in r]
            cr = any(isinstance(c, str) and "\r" in c for c in cells)
            (quoted if cr else writer).writerow(cells)
        out.write(text.getvalue().encode())
        text.seek(0)
        text.truncate()
        yield
    if text.tell():
        out.write(text.getvalue().encode())
    yield


def _arrow_schema(columns: list[tuple[str, str]]) -> Any:
    import pyarrow as pa

    types = {
        "int64": pa.int64(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
        "string": pa.string(),
        "timestamp": pa.timestamp("us", tz="UTC"),
    }
    return pa.schema([(name, types[kind]) for name, kind in columns])


def _arrow_value(v: Any) -> Any:
    if isinstance(v, datetime) and v.tzinfo is None:
        return v.replace(tzinfo=UTC)  # SQLite hands naive datetimes back; they were stored UTC
    return v


def write_parquet(table: Table, out: Any) -> Iterator[None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema(table.columns)
    with pq.ParquetWriter(pa.PythonFile(out, mode="w"), schema, compression="zstd") as writer:
        wrote = False
        for rows in table.batches():
            cols = list(zip(*rows, strict=True))
            arrays = [
                pa.array([_arrow_value(v) for v in col], type=field.type)
                for col, field in zip(cols, schema, strict=True)
            ]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
            wrote = True
            yield
        if not wrote:
            writer.write_table(schema.empty_table())
    yield
