# kvtier image: the cache service and the compute service (one image, the command picks).
#
#   docker build -t kvtier:cpu .                                   # CPU torch (default)
#   docker build -t kvtier:gpu --build-arg PIP_EXTRA_INDEX_URL= .  # CUDA torch from PyPI
#
# The install step is the README's own: `bash scripts/setup.sh`. No GPU is visible while an image
# builds, so setup.sh takes its CPU branch (`torch==<pinned version>`); which build of that torch
# pip finds is decided here by PIP_EXTRA_INDEX_URL: the PyTorch CPU index (default) offers the
# `+cpu` wheel, which pip prefers; with it emptied, PyPI's Linux wheel (CUDA bundled) is installed
# and setup.sh then adds the matching CuPy. The NVIDIA driver comes from the host at run time
# (NVIDIA Container Toolkit; compose profile `gpu`).
FROM python:3.11-slim

ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/kvtier
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip bash scripts/setup.sh

ENV PATH=/opt/kvtier/.venv/bin:$PATH \
    KVTIER_RUN_DIR=/run/kvtier
# gRPC (cache 50051, compute 50052) and Prometheus metrics (9400).
EXPOSE 50051 50052 9400
ENTRYPOINT ["/opt/kvtier/.venv/bin/python", "-m"]
CMD ["kvtier.cachesvc", "--help"]
