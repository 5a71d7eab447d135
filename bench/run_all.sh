#!/usr/bin/env bash
# Run every benchmark (see bench/README.md): bench/run_all.sh [--quick] [--only a,b]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m bench "$@"
