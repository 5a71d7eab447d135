"""qkscope's own tables (prefix `qk_`, beside Optuna's) and how to reach them."""
