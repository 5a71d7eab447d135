"""From asked trials to Ray tasks: each trial's config, fused groups, one Ray task per group.

The runner asks Optuna for trials (one by one, so a seeded random or grid sampler gives the
same numbers and parameters whatever `fuse` is) and hands them here as `Planned` trials.
With `fuse: 1` every trial is its own group and runs as `workers.remote.run_trial_task`, named
`study-<id>/trial-<n>` on the Ray dashboard. With `fuse > 1` trials whose configs share a
`workers.fusion_plan.fusion_key` (same tensor shapes and loop) form groups of at most `fuse` members
that run as one `run_trial_group_task`, named after its members, e.g.
`study-<id>/trials-4-7` (members 4 to 7) or `study-<id>/trials-2,5,9`. A group takes the
resources of one trial (`resources.cpus`/`gpus`) and Ray retries it as a whole; each member
resumes from its own checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray

from service.config import Settings
from service.spec import StudySpec, apply_params
from workers.config import TrialConfig
from workers.fusion_plan import group_by_key
from workers.remote import run_trial_group_task, run_trial_task

__all__ = ["Planned", "plan_groups", "submit", "suggest", "task_name", "trial_config"]

_trial_task = ray.remote(run_trial_task)
_group_task = ray.remote(run_trial_group_task)


@dataclass(frozen=True)
class Planned:
    """A trial asked from Optuna and recorded in our table, not launched yet."""

    trial: optuna.Trial
    params: dict[str, Any]
    row_id: int

    @property
    def number(self) -> int:
        return int(self.trial.number)


def suggest(spec: StudySpec, trial: optuna.Trial) -> dict[str, Any]:
    """Ask `trial` for a value of every search-space field (fixed ones included)."""
    params: dict[str, Any] = {}
    for path, p in spec.search_space.items():
        if p.type == "fixed":
            params[path] = p.value
        elif p.type == "categorical":
            params[path] = trial.suggest_categorical(path, p.choices)
        elif p.type == "float":
            params[path] = trial.suggest_float(path, p.low, p.high, log=p.log)
        else:
            params[path] = trial.suggest_int(path, p.low, p.high, log=p.log, step=p.step)
    return params


def trial_config(
    spec: StudySpec, settings: Settings, study_id: int, params: dict[str, Any], number: int
) -> TrialConfig:
    """The base config with the trial's params, its data dir resolved and its own
    checkpoint dir (`<checkpoint_dir>/study-<id>/trial-<n>`, also where its journal lives)."""
    config = apply_params(spec.base, params)
    task = config.task
    if task.data_dir and not Path(task.data_dir).is_absolute() and settings.data_dir:
        task = task.model_copy(update={"data_dir": str(Path(settings.data_dir) / task.data_dir)})
    ckpt_dir = Path(settings.resolved_checkpoint_dir()) / f"study-{study_id}" / f"trial-{number}"
    return config.model_copy(
        update={
            "task": task,
            "checkpoint": config.checkpoint.model_copy(update={"dir": str(ckpt_dir)}),
        }
    )


def plan_groups(
    spec: StudySpec, planned: list[Planned], configs: list[TrialConfig]
) -> list[tuple[list[Planned], list[TrialConfig]]]:
    """Split trials into launch groups: singletons with `fuse: 1`, else groups of equal
    fusion key (configs the fused model refuses get a group of their own)."""
    if spec.fuse <= 1:
        return [([p], [c]) for p, c in zip(planned, configs, strict=True)]
    return [
        ([planned[i] for i in idx], [configs[i] for i in idx])
        for idx in group_by_key(configs, spec.fuse)
    ]


def task_name(study_id: int, numbers: list[int]) -> str:
    """`study-<id>/trial-<n>` for one trial; `study-<id>/trials-<a>-<b>` for a group of the
    consecutive trials a..b; `study-<id>/trials-<a>,<b>,...` otherwise."""
    if len(numbers) == 1:
        return f"study-{study_id}/trial-{numbers[0]}"
    ordered = sorted(numbers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"study-{study_id}/trials-{ordered[0]}-{ordered[-1]}"
    return f"study-{study_id}/trials-{','.join(map(str, ordered))}"


def submit(
    spec: StudySpec, study_id: int, group: list[Planned], configs: list[TrialConfig], inbox: Any
) -> Any:
    """Start one Ray task for the group (one trial's resources); returns its ObjectRef. A
    single trial's task returns one result dict, a group's a list of them, in member order."""
    res = spec.resources
    numbers = [p.number for p in group]
    dumped = [c.model_dump(mode="json", by_alias=True) for c in configs]
    options: dict[str, Any] = {
        "name": task_name(study_id, numbers),
        "num_cpus": res.cpus,
        "num_gpus": res.gpus,
        "max_retries": spec.max_retries,
        "retry_exceptions": False,
    }
    if len(group) == 1:
        return _trial_task.options(**options).remote(dumped[0], numbers[0], inbox)
    return _group_task.options(**options).remote(dumped, numbers, inbox)
