# qkscope images, two build targets:
#   cpu  the API, the Ray head (which also runs the study runner jobs) and CPU workers:
#          docker build --target cpu -t qkscope:cpu .
#   gpu  GPU Ray workers: the same project with CUDA torch from PyTorch's CUDA index:
#          docker build --target gpu -t qkscope:gpu .
# (pick the cuXYZ index that matches the nodes' NVIDIA driver with CUDA_TORCH_INDEX_URL; the
# CUDA wheels bundle their CUDA libraries, so the slim base image is enough with the NVIDIA
# container toolkit on the host).  docker-compose.yml builds both.
#
# torch is installed first, from PyTorch's own wheel index, so that installing the project
# finds the pyproject pin (torch==2.13.0) already satisfied and keeps that build.  The
# project is installed normally from its wheel (not editable): the wheel ships the Alembic
# migrations as the package `qkscope_migrations`.

# Must equal the torch pin in pyproject.toml (tests/test_compose.py checks it).
ARG TORCH_VERSION=2.13.0

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# Unprivileged user; /checkpoints is the mount point of the shared checkpoint volume
# (a fresh named volume takes this ownership).
RUN useradd --create-home --uid 1000 qkscope \
    && mkdir -p /checkpoints /app/.qkscope \
    && chown -R qkscope:qkscope /checkpoints /app/.qkscope

# The project's wheel, built once for both targets.
FROM base AS wheel
COPY pyproject.toml setup.py README.md ./
COPY service/ service/
COPY workers/ workers/
COPY migrations/ migrations/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Own layer: torch is by far the largest dependency and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/qkscope-*.whl && rm -rf /wheels
COPY study_defs/ study_defs/
USER qkscope
# 8000: API; 8265: Ray dashboard / job server; 6390: Ray GCS (not 6379, Redis's port).
EXPOSE 8000 8265 6390
# Refuses to start on 0.0.0.0 unless QKSCOPE_API_TOKENS is set (no open API by default).
CMD ["qkscope", "serve", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS gpu
ARG TORCH_VERSION
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN pip install --index-url "${CUDA_TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/qkscope-*.whl && rm -rf /wheels
COPY study_defs/ study_defs/
USER qkscope
EXPOSE 6390
# A GPU worker joins the cluster (docker-compose.yml gives the address and its GPU set).
CMD ["ray", "start", "--address=ray-head:6390", "--block", "--disable-usage-stats"]
