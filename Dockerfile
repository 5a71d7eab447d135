# qkscope: one image for the API, the Ray head (which also runs the study runner jobs)
# and the Ray workers.  Build:  docker compose build   (or: docker build -t qkscope:local .)
#
# torch is installed first, from PyTorch's own wheel index, so that `pip install .`
# finds the pyproject pin (torch==2.13.0) already satisfied and keeps that build.
# The default is the CPU build.  For GPU worker nodes build with the CUDA wheels of the
# same torch 2.13.0, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .
# (pick the cuXYZ index that matches the node's NVIDIA driver; the CUDA wheels bundle
# their CUDA libraries, so this slim base image is enough with the NVIDIA container
# toolkit on the host).  docker-compose.yml passes TORCH_INDEX_URL from .env.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Must equal the torch pin in pyproject.toml (tests/test_compose.py checks it).
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Own layer: torch is by far the largest dependency and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY service/ service/
COPY workers/ workers/
COPY migrations/ migrations/
COPY study_defs/ study_defs/

# Editable on purpose: service/db/migrate.py finds Alembic's migrations/ next to the
# source tree (/app/migrations), which a site-packages copy of the package would not see.
RUN pip install -e .

# Unprivileged user; /checkpoints is the mount point of the shared checkpoint volume
# (a fresh named volume takes this ownership).
RUN useradd --create-home --uid 1000 qkscope \
    && mkdir -p /checkpoints /app/.qkscope \
    && chown -R qkscope:qkscope /checkpoints /app/.qkscope
USER qkscope

# 8000: API; 8265: Ray dashboard / job server; 6390: Ray GCS (not 6379, Redis's port).
EXPOSE 8000 8265 6390

# Refuses to start on 0.0.0.0 unless QKSCOPE_API_TOKENS is set (no open API by default).
CMD ["qkscope", "serve", "--host", "0.0.0.0", "--port", "8000"]
