"""From an asked trial to what trains it: its parameters, its config, its worker's key.

The runner asks Optuna for trials one by one (when a slot waits for one, so that a seeded
random or grid sampler gives the same numbers and parameters whatever `fuse` is); each
trial's config is the study's base config with its parameters, its data directory
resolved and a checkpoint directory of its own. Its slot key says which workers may take
it: with `fuse: 1` any one-slot worker of its device and precision; otherwise only a
worker of its fusion key (same architecture, shapes and loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from service.config import Settings
from service.spec import StudySpec, apply_params, resolve_task
from workers.config import TrialConfig
from workers.fusion_plan import FusionError, auto_fuse, check_fusable, fusion_key
from workers.metric_names import SUMMARY_BY_NAME
from workers.stopping import StopRule, can_recover

__all__ = ["pruned_objective", "slot_key", "stop_rules", "suggest", "trial_config"]


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
    """The base config with the trial's params, its data dir resolved (and the data root it
    must stay inside, `task.data_root`, set from QKSCOPE_DATA_DIR) and its own
    checkpoint dir (`<checkpoint_dir>/study-<id>/trial-<n>`, also where its journal lives),
    claimed by `owner`'s trial (a directory another study left there is emptied first).
    Raises `service.spec.SpecError` when the parameters give no valid config."""
    config = apply_params(spec.base, params)
    task = resolve_task(config.task, settings.data_dir)
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


def slot_key(spec: StudySpec, config: TrialConfig, number: int) -> tuple[str, int]:
    """Which workers may train the trial, and how many slots a new one of them gets.

    One slot per worker (`fuse: 1`, or `fuse: auto` where the base config does not gain):
    any one-slot worker of the same device and precision (it trains whatever it is given
    with the plain runner). Otherwise the trial's fusion key: a config the fused model
    refuses gets a key (and a one-slot worker) of its own; with `fuse: auto` each key gets
    what `auto_fuse` says its own config gains (a grid over depth holds keys whose steps
    cost 10x the base config's, where fusion on a CPU no longer pays).
    """
    if spec.slots == 1:
        return f"one:{config.device}:{config.dtype}:{config.compile}", 1
    try:
        check_fusable(config)
    except FusionError:
        return f"alone:{number}", 1
    if spec.fuse == "auto":
        return fusion_key(config), auto_fuse(config, spec.resources.gpus)
    return fusion_key(config), spec.slots


def stop_rules(spec: StudySpec, steps: int | None = None) -> tuple[StopRule, ...]:
    """The study's constraints as rules a worker checks at every evaluation (none with
    `pruner.stop_infeasible: false`): a violation that can never be undone stops the trial
    at that evaluation; any other after `pruner.infeasible_patience` in a row. `steps`: the
    trial's own (a searched `steps`; the base config's when None), what a constraint's
    `fraction_of_steps` is a fraction of."""
    steps = spec.base.steps if steps is None else steps
    if not spec.pruner.stop_infeasible:
        return ()
    rules = []
    for c in spec.constraints:
        if not SUMMARY_BY_NAME[c.metric].intermediate:
            continue
        bound = c.value if c.value is not None else (c.fraction_of_steps or 0.0) * steps
        patience = spec.pruner.infeasible_patience if can_recover(c.metric, c.op) else 1
        rules.append(StopRule(c.metric, c.op, float(bound), patience))
    return tuple(rules)


def pruned_objective(spec: StudySpec) -> str | None:
    """The summary whose intermediate value a worker reports at each evaluation, for
    Optuna's pruner: the study's objective, or None without a pruner (nothing to compare)."""
    return None if spec.pruner.kind == "none" else spec.objectives[0].metric
