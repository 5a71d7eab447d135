"""A language-modelling task's data in the forms of docs/your-data.md: a text corpus
tokenized by bytes, a trained byte-level BPE or the user's `tokenizer.json`; pre-tokenized
`.bin` files (nanoGPT's); a local Parquet, JSONL or `save_to_disk` dataset.

- workers/data/layout.py: where each form keeps a split, and the cheap checks the API runs
  at POST and the workers before loading (torch-free, no tokenizing).
- workers/data/encode.py: the tokenizers (bytes, BPE training and its cache, a tokenizer file).
- workers/data/corpus.py: both splits as token ids, for workers/tasks_lm.py.
- workers/data/cache.py: the cache directory and safe writes under concurrent trials.

`tokenizers` and `datasets` are imported only by the forms that need them.
"""
