"""One trial: train a small transformer with an eigenspectrum regularizer and probe it.

`run_trial(config, reporter)` is what a Ray worker runs. Every `eval_every`
steps it measures validation loss and, on a fixed probe batch, every metric of
docs/metrics.md per layer and head; hands them to the reporter (which may
answer "stop": that is how pruning works); and writes a checkpoint that a
rerun of the same config resumes from with the same result. A NaN/inf loss
ends the trial as `diverged`, with the metrics measured so far.

With `eval_at_init` the untrained model is measured too, once, as step 0 (the
"at initialisation" curves of Dong et al. 2021): reported like any evaluation,
kept in the checkpoint so a resumed trial never re-reports it, and summarised
in the `init_*` fields only, so every other summary field means the same with
or without it (an evaluation uses no randomness, so training is unchanged).

The loop itself is the trial engine's (workers/engine.py), here with one slot over a plain
GPT and torch's optimizer: a fused member (workers/fused.py) is the same loop, evaluation,
checkpoint and stop record with a batched model runner.

Run one from a shell: `python -m workers.trial CONFIG.yaml`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from workers.config import (
    CheckpointConfig,
    MetricPoint,
    OptimConfig,
    RegularizerConfig,
    TrialConfig,
    TrialSummary,
)
from workers.engine import NAN_CHECK_EVERY, Engine
from workers.evaluation import probe_metrics
from workers.member import (
    NullReporter,
    Reporter,
    autocast_for,
    build_model,
    new_member,
    resolve_device,
)
from workers.runners import PlainRunner
from workers.stopping import StopRule

__all__ = [
    "NAN_CHECK_EVERY",
    "CheckpointConfig",
    "MetricPoint",
    "NullReporter",
    "OptimConfig",
    "RegularizerConfig",
    "Reporter",
    "TrialConfig",
    "TrialSummary",
    "build_model",
    "probe_metrics",
    "resolve_device",
    "run_trial",
]


def run_trial(
    config: TrialConfig,
    reporter: Reporter | None = None,
    *,
    progress: Callable[[int], None] | None = None,
    stop_rules: Sequence[StopRule] = (),
    objective: str | None = None,
) -> TrialSummary:
    """Train, probe every `eval_every` steps, report, checkpoint; return the summary.

    With `config.eval_at_init`, the untrained model is evaluated and reported first, as
    step 0 (no train loss or gradient norm exists yet); never again after a resume. A trial
    whose checkpoint directory records that it stopped returns that summary untrained. With
    `stop_rules`, it stops (pruned) once it can no longer meet them (workers/stopping.py);
    with `objective`, each report carries that summary's intermediate value.
    """
    device = resolve_device(config)
    ctx = autocast_for(config, device)
    engine = Engine(PlainRunner(ctx), device, ctx, progress=progress)
    member = new_member(config, reporter, device, stop_rules=stop_rules, objective=objective)
    engine.admit(member)
    engine.run()
    assert member.summary is not None
    return member.summary


def load_config(path: str | Path) -> TrialConfig:
    """A TrialConfig from a YAML or JSON file."""
    import yaml

    return TrialConfig.model_validate(yaml.safe_load(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    """`python -m workers.trial CONFIG.yaml`: one trial with a progress bar, summary as JSON."""
    from tqdm import tqdm

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.trial CONFIG.yaml", file=sys.stderr)
        return 2
    config = load_config(args[0])
    with tqdm(total=config.steps, unit="step", file=sys.stderr) as bar:
        summary = run_trial(config, progress=lambda s: bar.update(s - bar.n))
    print(json.dumps(summary.model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
