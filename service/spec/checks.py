"""The checks of a study definition beyond its model (service/spec/model.py): parsing a
body (JSON or YAML, bounded), every point of the search space (service/spec/space.py), the
deployment's limits and the data directory. Each error names the dotted field.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from service.spec.model import (
    SpecError,
    StudySpec,
    apply_params,
    count_params,
    extremes,
    vocab_size,
)
from service.spec.space import check_memory, check_search_space, worst_points

if TYPE_CHECKING:
    from service.spec.limits import Limits
    from workers.config import TaskConfig, TrialConfig
    from workers.data.layout import DataProblem

__all__ = [
    "DATA_DIR_RULE",
    "FILE_RULE",
    "MAX_DATA_CHECKS",
    "MAX_NESTING",
    "check_data_dirs",
    "check_data_files",
    "check_limits",
    "parse_spec",
]


def check_limits(
    spec: StudySpec,
    *,
    max_trials: int,
    max_steps: int,
    max_params: int,
    max_memory: int | None = None,
    limits: Limits | None = None,
) -> list[SpecError]:
    """Deployment limits that depend on settings rather than on the spec alone: trials,
    steps, parameters, (`max_memory`, QKSCOPE_MAX_TRIAL_MEMORY_BYTES) the memory of one
    worker at the largest point of the search space (service/spec/space.py, `check_memory`), and
    what `limits` bounds (service/spec/limits.py: the grid, evaluations, metric rows, checkpoint
    bytes, string lengths)."""
    errors: list[SpecError] = []
    if spec.budget.n_trials > max_trials:
        errors.append(SpecError("budget.n_trials", f"{spec.budget.n_trials} > limit {max_trials}"))
    worst = dict.fromkeys(("steps",), spec.base.steps)
    for path, p in spec.search_space.items():
        values = extremes(p)
        if path == "steps":
            worst["steps"] = max(int(float(v)) for v in values)
    if worst["steps"] > max_steps:
        errors.append(SpecError("base.steps", f"{worst['steps']} > limit {max_steps}"))
    n = 0
    for _, big in worst_points(spec):  # the largest values together, valid or not
        n = max(n, count_params(big, vocab_size(big)))
    if n > max_params:
        errors.append(SpecError("base.model", f"about {n:,} parameters > limit {max_params:,}"))
    if max_memory is not None:
        errors += check_memory(spec, max_memory)
    if limits is not None:
        errors += limits.check(spec)
    return errors


DATA_DIR_RULE = (
    "must be a relative path inside the data directory (QKSCOPE_DATA_DIR): no leading '/' "
    "or '~', no '..', and no symlink out of it"
)


DATA_ROOT_RULE = (
    "is set by the service (QKSCOPE_DATA_DIR, where a trial's data must stay); leave it out"
)


def _data_dir_escapes(value: str, root: str) -> bool:
    """Whether `value` (a task.data_dir) may point outside `root` (QKSCOPE_DATA_DIR; "" when
    unset: then relative paths are read from the workers' working directory, and only the
    spelling is checked). Existing symlinks under `root` are followed; whether anything
    outside `root` exists never changes the answer, so the 422 tells nothing about it."""
    path = PurePosixPath(value)
    if not value or path.is_absolute() or value.startswith("~") or ".." in path.parts:
        return True
    if "\\" in value or "\x00" in value:
        return True
    if not root:
        return False
    try:
        base = Path(root).resolve()
        target = (base / path).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long
        return True
    return target != base and base not in target.parents


def check_data_dirs(spec: StudySpec, root: str) -> list[SpecError]:
    """`base.task.data_dir` and every value the search space gives `task.data_dir` stay
    inside `root` (QKSCOPE_DATA_DIR), where the runner resolves them (service/runner/configs.py);
    then, with a root, the data forms of docs/your-data.md are checked there
    (`check_data_files`). `task.data_root` is the service's to set (the worker checks the
    data against it again when a trial opens it), never the definition's."""
    errors: list[SpecError] = []
    if spec.base.task.data_root is not None:
        errors.append(SpecError("base.task.data_root", DATA_ROOT_RULE))
    if "task.data_root" in spec.search_space:
        errors.append(SpecError("search_space.task.data_root", DATA_ROOT_RULE))
    base = spec.base.task.data_dir
    if base is not None and _data_dir_escapes(base, root):
        errors.append(SpecError("base.task.data_dir", DATA_DIR_RULE))
    param = spec.search_space.get("task.data_dir")
    if param is not None:
        for v in extremes(param):
            if isinstance(v, str) and _data_dir_escapes(v, root):
                errors.append(SpecError("search_space.task.data_dir", DATA_DIR_RULE))
                break
    if errors or not root:
        return errors
    return check_data_files(spec, root)


MAX_DATA_CHECKS = 16
"""Distinct data settings (base and searched values) whose files one POST checks; a study
that searches more has the rest checked by the workers (a trial fails, not the study)."""

FILE_RULE = "must stay inside the data directory (QKSCOPE_DATA_DIR): no symlink out of it"


def check_data_files(spec: StudySpec, root: str) -> list[SpecError]:
    """The cheap checks of workers/data/layout.py (files there and not empty, a `.bin`
    file's size and its first `POST_SCAN_TOKENS` ids below `vocab_size`, a tokenizer file's
    ids, a dataset's text column) on the base task and on each value the search space gives
    a task field, for the forms `needs_data_check` covers, under `root`. Each error names
    the field: `base.task.<field>`, or the searched `search_space.task.<field>`. Paths that
    lead out of `root` through a symlink get `FILE_RULE`, whatever is outside."""
    from workers.data.layout import check_data, needs_data_check

    points: list[tuple[str | None, TrialConfig]] = [(None, spec.base)]
    for path, param in spec.search_space.items():
        if path.startswith("task."):
            for v in extremes(param):
                try:
                    points.append((path, apply_params(spec.base, {path: v})))
                except SpecError:
                    continue  # refused by the spec's own checks already
    base = Path(root).resolve()
    errors: list[SpecError] = []
    seen: set[str] = set()
    for searched, config in points:
        task = config.task
        if not needs_data_check(task) or task.data_dir is None:
            continue
        key = task.model_dump_json()
        if key in seen or _data_dir_escapes(task.data_dir, root):
            continue
        seen.add(key)
        if len(seen) > MAX_DATA_CHECKS:
            break
        problems = [
            *_escaping_files(task, base),
            *check_data(task, base / task.data_dir, task.data_dir),
        ]
        for p in problems[:1]:  # what follows from the first problem is noise
            field = f"base.task.{p.field}" if searched is None else f"search_space.{searched}"
            where = "" if searched is None else f"task.{p.field}: "
            errors.append(SpecError(field, where + p.message))
            if searched is None:
                return errors  # the searched values share the base's problem
    return errors


def _escaping_files(task: TaskConfig, base: Path) -> list[DataProblem]:
    """The first of a task's data files that resolves outside `base` (a symlink out of the
    data root), as a problem that tells nothing about what is outside."""
    from workers.data.layout import DataProblem, bin_path, dataset_split, text_path

    assert task.data_dir is not None
    d = base / task.data_dir
    files: list[tuple[str, Path]] = []
    if task.format == "dataset":  # read to find the splits: checked before it is read
        listing = d / "dataset_dict.json"
        target = listing.resolve() if listing.is_symlink() else listing
        if base not in target.parents:
            return [DataProblem("data_dir", FILE_RULE)]
    for field, split in (("train_split", task.train_split), ("valid_split", task.valid_split)):
        if task.format == "bin":
            files.append((field, bin_path(d, split)))
        elif task.format == "text":
            files.append((field, text_path(d, split)))
        else:
            where = dataset_split(d, split)
            files += [(field, p) for p in (where.paths if where is not None else ())]
    if task.tokenizer == "file" and task.format != "bin":
        files.append(("tokenizer_file", d / task.tokenizer_file))
    for field, path in files:
        try:
            target = path.resolve()
        except (OSError, RuntimeError):
            return [DataProblem(field, FILE_RULE)]
        if base not in target.parents:
            return [DataProblem(field, FILE_RULE)]
    return []


MAX_NESTING = 128


def _check_nesting(text: str) -> None:
    """Refuse deeply nested documents before a parser spends time (or its stack) on them."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    indent = max((len(line) - len(line.lstrip(" ")) for line in text.splitlines()), default=0)
    if deepest > MAX_NESTING or indent > 4 * MAX_NESTING:
        raise SpecError("body", f"nested deeper than {MAX_NESTING} levels")


def parse_spec(body: bytes, content_type: str) -> StudySpec:
    """Parse JSON or YAML (safe loader, no aliases, bounded nesting) into a StudySpec."""
    text = body.decode("utf-8")
    _check_nesting(text)
    data: Any
    if "json" in content_type:
        data = json.loads(text)
    else:
        loader = yaml.SafeLoader(text)
        try:
            if any(
                isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=yaml.SafeLoader)
            ):
                raise SpecError("body", "YAML aliases are not accepted")
            data = loader.get_single_data()
        finally:
            loader.dispose()
    if not isinstance(data, dict):
        raise SpecError("body", "a study definition must be a mapping")
    spec = StudySpec.model_validate(data)
    field = _bool_for_number(data, spec.model_dump(mode="json", by_alias=True))
    if field is not None:  # pydantic's lax mode reads true as 1
        raise SpecError(field, "expected a number, got a boolean")
    check_search_space(spec)  # every point the sampler can suggest, not only the endpoints
    return spec


def _bool_for_number(data: Any, dumped: Any, path: str = "") -> str | None:
    """The first field where the input says true/false and the validated spec holds a number."""
    if isinstance(data, bool):
        return path if isinstance(dumped, int | float) and not isinstance(dumped, bool) else None
    pairs: list[tuple[str, Any, Any]] = []
    if isinstance(data, dict) and isinstance(dumped, dict):
        pairs = [(str(k), v, dumped[k]) for k, v in data.items() if k in dumped]
    elif isinstance(data, list) and isinstance(dumped, list) and len(data) == len(dumped):
        pairs = [(str(i), a, b) for i, (a, b) in enumerate(zip(data, dumped, strict=True))]
    for key, a, b in pairs:
        if (hit := _bool_for_number(a, b, f"{path}.{key}" if path else key)) is not None:
            return hit
    return None
