"""Progress display for `Client.wait`: a notebook bar in Jupyter, a tqdm bar on a terminal,
and otherwise (logs, pipes, CI) one plain line each time something changes."""

from __future__ import annotations

import sys
from typing import Any, Protocol, TextIO

from qkscope.models import Summary

__all__ = ["Progress", "make_progress", "summary_line"]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def summary_line(s: Summary) -> str:
    """`study 3: RUNNING, 2/8 finished, 2 running, best 1.234` (and `, waiting: <why>` while
    the study is stuck: no node fits its trials, Ray does not answer)."""
    line = (
        f"study {s.study_id}: {s.status}, {s.finished}/{s.n_trials} finished, "
        f"{s.running} running, best {_fmt(s.best_value)}"
    )
    return f"{line}, waiting: {s.waiting_reason}" if s.waiting_reason else line


class Progress(Protocol):
    def update(self, s: Summary) -> None: ...
    def close(self) -> None: ...


class _Silent:
    def update(self, s: Summary) -> None:
        pass

    def close(self) -> None:
        pass


class _Lines:
    """A line only when status, finished, running or best changed: no `\\r` spam in logs."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.last: tuple[Any, ...] | None = None

    def update(self, s: Summary) -> None:
        key = (s.status, s.finished, s.running, s.best_value, s.waiting_reason)
        if key != self.last:
            self.last = key
            print(summary_line(s), file=self.file, flush=True)

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, study_id: int, notebook: bool, file: TextIO) -> None:
        if notebook:
            from tqdm.auto import tqdm
        else:
            from tqdm import tqdm
        self.bar = tqdm(total=None, unit="trial", desc=f"study {study_id}", file=file)

    def update(self, s: Summary) -> None:
        self.bar.total = s.n_trials
        self.bar.n = s.finished
        extra = {"waiting": s.waiting_reason} if s.waiting_reason else {}
        self.bar.set_postfix(status=s.status, running=s.running, best=_fmt(s.best_value), **extra)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython's ZMQ shell)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def make_progress(
    study_id: int, progress: bool | str = True, file: TextIO | None = None
) -> Progress:
    """`progress`: False (silent), True (pick by where we run), or "bar" / "lines"."""
    out = file or sys.stderr
    if progress is False:
        return _Silent()
    if progress == "lines":
        return _Lines(out)
    if in_notebook():
        return _Bar(study_id, notebook=True, file=out)
    is_tty = getattr(out, "isatty", lambda: False)()
    if progress == "bar" or is_tty:
        return _Bar(study_id, notebook=False, file=out)
    return _Lines(out)
