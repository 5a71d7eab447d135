"""The unigram floor of a language-modelling trial (METRICS.md section 9).

A model that has learned only how often each token occurs, and nothing about context, scores
the cross-entropy of the training split's token frequencies on the evaluation targets. A
study whose best loss is not below that number has not yet learned what attention is for, so
its attention results say nothing about attention. The floor is computed on exactly the
targets the trial's `val_loss` averages over (the first `eval_batches` validation batches,
the mean of per-batch means), with add-one smoothing over the vocabulary so that a token
the training split never shows costs `log(N + V)` rather than infinity (a difference of
about `V / N` nats: 0.002 on word-level WikiText-2 capped at 500 words). Importable
without torch (the service reports the floor beside LR sensitivity).
"""

from __future__ import annotations

import functools

import numpy as np

from workers.config import TaskConfig, TrialConfig

__all__ = ["unigram_floor"]


def unigram_floor(config: TrialConfig) -> float | None:
    """The unigram cross-entropy (nats) on the trial's evaluation targets; None for a task
    that is not language modelling (a synthetic task has no corpus frequencies)."""
    if config.task.kind != "lm":
        return None
    return _floor(config.task.model_dump_json(), config.batch_size, config.eval_batches)


@functools.lru_cache(maxsize=32)
def _floor(task_json: str, batch_size: int, eval_batches: int) -> float:
    from workers.tasks_lm import LMTask  # torch: imported where the floor is computed

    task = LMTask(TaskConfig.model_validate_json(task_json))
    train = np.asarray(task.train_ids, dtype=np.int64)
    counts = np.bincount(train, minlength=task.vocab_size).astype(np.float64)
    log_p = np.log((counts + 1.0) / (counts.sum() + task.vocab_size))
    per_batch = []
    for _, y in task.valid_batches(batch_size)[:eval_batches]:
        per_batch.append(float(-log_p[np.asarray(y)].mean()))
    return float(np.mean(per_batch))
