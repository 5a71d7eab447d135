"""The checks of a study definition beyond its model (service/spec/model.py): parsing a
body (JSON or YAML, bounded), every point of the search space (service/spec/space.py), the
deployment's limits and the data directory. Each error names the dotted field.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml

from service.spec.model import SpecError, StudySpec, count_params, extremes, vocab_size
from service.spec.space import check_memory, check_search_space, worst_points

if TYPE_CHECKING:
    from service.spec.limits import Limits

__all__ = ["DATA_DIR_RULE", "MAX_NESTING", "check_data_dirs", "check_limits", "parse_spec"]


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
    `task.data_root` is the service's to set (the worker checks the data against it again
    when a trial opens it), never the definition's."""
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
    return errors


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
