# A python:3.11-slim stand-in for machines that cannot pull from Docker Hub: Debian
# bookworm's own Python 3.11 (from a debootstrapped root file system that
# `docker import` made into DEBIAN_IMAGE), in a virtual environment at /usr/local/py whose
# `python` and `pip` come first on PATH, as they do in the official image.  Built by
# scripts/compose-smoke and handed to the Dockerfile as BASE_IMAGE.
ARG DEBIAN_IMAGE=qkscope-smoke-debian:bookworm
FROM ${DEBIAN_IMAGE}
ENV PATH=/usr/local/py/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
RUN python3 -m venv /usr/local/py && /usr/local/py/bin/python --version
CMD ["python"]
