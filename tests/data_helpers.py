"""Helpers shared by the data-form tests (tests/workers/test_data_forms.py,
tests/service/test_data_bad_input.py, tests/service/test_data_e2e.py): the real WikiText-2
splits, corpus directories built from them, and scripts/data_forms.py (the users' tool that
writes every form)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2"


def wikitext(split: str, n_lines: int | None = None) -> str:
    """The real WikiText-2 `split` (valid or test), or its first `n_lines` lines."""
    text = (WIKITEXT / f"{split}.txt").read_text(encoding="utf-8")
    if n_lines is None:
        return text
    return "".join(text.splitlines(keepends=True)[:n_lines])


def text_dir(directory: Path, **splits: str) -> Path:
    """A text corpus directory: `<split>.txt` for each keyword."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem, text in splits.items():
        (directory / f"{stem}.txt").write_text(text, encoding="utf-8")
    return directory


def bin_dir(directory: Path, dtype: str = "uint16", **splits: np.ndarray) -> Path:
    """A `.bin` directory: `<split>.bin` holding each keyword's ids as `dtype`."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem, ids in splits.items():
        np.asarray(ids, dtype=dtype).tofile(directory / f"{stem}.bin")
    return directory


def data_forms() -> ModuleType:
    """scripts/data_forms.py as a module."""
    name = "qkscope_data_forms_script"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "data_forms.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
