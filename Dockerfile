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

#
# Build arguments for machines that cannot reach Docker Hub or PyTorch's index (the
# defaults are what a user gets; scripts/compose-smoke shows them used):
#   BASE_IMAGE      an image with Python 3.11 whose `python` and `pip` are on PATH
#                   (default python:3.11-slim)
#   TORCH_WHEELS    a folder in the build context; a torch-*.whl there is installed instead
#                   of torch from TORCH_INDEX_URL (cpu target; default docker/torch-wheels,
#                   which holds none)
#   EXTRA_CA_CERTS  a folder in the build context; its *.crt / *.pem files are added to the
#                   CA bundle pip uses (a TLS-inspecting proxy; default docker/extra-ca,
#                   which holds none, and then pip keeps its own bundle)

# Must equal the torch pin in pyproject.toml (tests/test_compose.py checks it).
ARG TORCH_VERSION=2.13.0
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
ARG EXTRA_CA_CERTS=docker/extra-ca
COPY ${EXTRA_CA_CERTS}/ /tmp/extra-ca/
RUN set -e; extra=$(find /tmp/extra-ca -type f \( -name '*.crt' -o -name '*.pem' \)); \
    if [ -n "$extra" ]; then \
      bundle=/etc/ssl/certs/qkscope-pip-bundle.pem; \
      cat $(python -c 'import ssl; print(ssl.get_default_verify_paths().openssl_cafile)') \
          $extra > "$bundle" 2>/dev/null || cat $extra > "$bundle"; \
      printf '[global]\ncert = %s\n' "$bundle" > /etc/pip.conf; \
    fi; \
    rm -rf /tmp/extra-ca
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
COPY qkscope/ qkscope/
COPY migrations/ migrations/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_WHEELS=docker/torch-wheels
# Own layer: torch is by far the largest dependency and changes least often.  A wheel handed
# in through TORCH_WHEELS must be torch==TORCH_VERSION (its own deps come from PyPI).
COPY ${TORCH_WHEELS}/ /tmp/torch-wheels/
RUN set -e; wheel=$(find /tmp/torch-wheels -name "torch-${TORCH_VERSION}*.whl" | head -n1); \
    if [ -n "$wheel" ]; then pip install "$wheel"; \
    else pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; fi; \
    rm -rf /tmp/torch-wheels
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
