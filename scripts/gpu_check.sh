#!/usr/bin/env bash
# The GPU figures in one call of a lent device (issue 47): bench.gpu (bare loop vs run_trial vs
# fused, tokens/s and MFU) and one Hugging Face Llama trial of study_defs/hf_llama_gpu.yaml,
# shortened. Carries: .gpu-carry/whl (pydantic, transformers, tokenizers ... for cp312) and
# .gpu-carry/data/wikitext-2. Output under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-carry/whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 QKSCOPE_DATA_DIR=$PWD/.gpu-carry/data
nvidia-smi -L; git rev-parse HEAD 2>/dev/null || true
python3 -c "import torch, transformers, pydantic; print(torch.__version__, transformers.__version__)"
timeout "${BENCH_S:-260}" python3 -m bench.gpu --quick --data-dir "$PWD/.gpu-carry/data/wikitext-2" 2>&1 | tee "$OUT/bench_gpu.txt"
timeout "${HF_S:-200}" python3 scripts/gpu_hf_trial.py --steps "${HF_STEPS:-300}" 2>&1 | tee "$OUT/hf_trial.txt"
