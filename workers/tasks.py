"""Training data for qkscope trials, behind one small interface.

Every trial trains a causal decoder-only transformer on a :class:`Task`. A task hands out
``(x, y)`` batches of int64 token ids of shape ``(B, seq_len)`` on the CPU, where ``y[b, t]`` is
the target for position ``t`` (the next token for language modelling) and :data:`IGNORE_INDEX`
(``-100``, the default ``ignore_index`` of ``torch.nn.functional.cross_entropy``) wherever no
loss is taken.

Two properties matter for the study service and are guaranteed by every task here:

* ``train_batch`` draws randomness only from the ``torch.Generator`` it is given, so a training
  stream can be reproduced and resumed exactly by saving and restoring that generator's state.
  The global torch RNG is never touched.
* ``valid_batches`` returns the same batches on every call, independent of any generator, so
  validation losses are comparable across steps, trials and restarts.

Task kinds:

* ``lm``: language modelling on ``<data_dir>/<split>.txt`` files (e.g. WikiText-2), word or
  character level with the vocabulary from the training split only; or on the forms of
  docs/your-data.md (workers/data/): text tokenized by bytes, a byte-level BPE trained on the
  training split or the user's ``tokenizer.json``; nanoGPT's ``.bin`` token files; a local
  Parquet, JSONL or ``save_to_disk`` dataset. Their vocabulary is ``task.vocab_size``.
* ``associative_recall``: key-value pairs, then a query key; predict its value.
* ``sort``: a random sequence, a separator, then the sorted sequence (Dong et al.).
* ``copy``: a random sequence, a separator, then the same sequence.

The synthetic tasks have a known optimum of zero loss (the answer is determined by the input),
which lets the study measure how far a configuration is from solving the task.

The language-modelling task lives in workers/tasks_lm.py, the synthetic ones in
workers/tasks_synthetic.py, the interface they share in workers/tasks_base.py; every name is
re-exported here.
"""

from __future__ import annotations

from workers.config import TaskConfig
from workers.tasks_base import IGNORE_INDEX, Task
from workers.tasks_lm import EOS_TOKEN, MAX_VALID_BATCHES, UNK_TOKEN, LMTask, clear_corpus_cache
from workers.tasks_synthetic import AssociativeRecallTask, CopyTask, SortTask

__all__ = [
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "MAX_VALID_BATCHES",
    "UNK_TOKEN",
    "AssociativeRecallTask",
    "CopyTask",
    "LMTask",
    "SortTask",
    "Task",
    "TaskConfig",
    "build_task",
    "clear_corpus_cache",
]


def build_task(config: TaskConfig, seed: int) -> Task:
    """Build the task described by ``config``.

    ``seed`` fixes the synthetic validation set; language-modelling validation is a fixed
    slice of the validation split and does not depend on it.
    """
    if config.kind == "lm":
        return LMTask(config)
    if config.kind == "associative_recall":
        return AssociativeRecallTask(config, seed)
    if config.kind == "sort":
        return SortTask(config, seed)
    if config.kind == "copy":
        return CopyTask(config, seed)
    raise ValueError(f"unknown task kind {config.kind!r}")  # pragma: no cover
