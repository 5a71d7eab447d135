"""From asked trials to what runs them: each trial's config, and the Ray task of one trial.

The runner asks Optuna for trials (one by one, when a slot waits for one, so a seeded random
or grid sampler gives the same numbers and parameters whatever `fuse` is) and hands them
here as `Planned` trials. With `fuse: 1` every trial runs as its own
`workers.remote.run_trial_task`, named `study-<id>/trial-<n>` on the Ray dashboard, which Ray
retries (`max_retries`) and which resumes from its checkpoint. With `fuse > 1` trials go to
slot workers instead (service/slots.py).
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
from workers.remote import run_trial_task

__all__ = ["Planned", "submit", "suggest", "task_name", "trial_config"]

_trial_task = ray.remote(run_trial_task)


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
    spec: StudySpec,
    settings: Settings,
    study_id: int,
    params: dict[str, Any],
    number: int,
    owner: str | None = None,
) -> TrialConfig:
    """The base config with the trial's params, its data dir resolved and its own
    checkpoint dir (`<checkpoint_dir>/study-<id>/trial-<n>`, also where its journal lives),
    claimed by `owner`'s trial (a directory another study left there is emptied first)."""
    config = apply_params(spec.base, params)
    task = config.task
    if task.data_dir and not Path(task.data_dir).is_absolute() and settings.data_dir:
        task = task.model_copy(update={"data_dir": str(Path(settings.data_dir) / task.data_dir)})
    ckpt_dir = Path(settings.resolved_checkpoint_dir()) / f"study-{study_id}" / f"trial-{number}"
    return config.model_copy(
        update={
            "task": task,
            "checkpoint": config.checkpoint.model_copy(
                update={
                    "dir": str(ckpt_dir),
                    "owner": None if owner is None else f"{owner}/trial-{number}",
                }
            ),
        }
    )


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
    spec: StudySpec, study_id: int, planned: Planned, config: TrialConfig, inbox: Any
) -> Any:
    """Start the Ray task of one trial (`resources.cpus`/`gpus`, Ray retries up to
    `max_retries`); returns its ObjectRef, whose value is the trial's result dict."""
    res = spec.resources
    return _trial_task.options(
        name=task_name(study_id, [planned.number]),
        num_cpus=res.cpus,
        num_gpus=res.gpus,
        max_retries=spec.max_retries,
        retry_exceptions=False,
    ).remote(config.model_dump(mode="json", by_alias=True), planned.number, inbox)
