# syntax=docker/dockerfile:1
# One image for all three services: `tandem draft-service`, `tandem target-service`,
# `tandem orchestrator` (the Kubernetes manifests pass the subcommand as args).
#
#   docker build --build-arg VARIANT=cpu  -t tandem:0.1.0-cpu  .
#   docker build --build-arg VARIANT=cuda -t tandem:0.1.0-cuda .
#
# VARIANT picks the torch wheel; nothing else differs. The CUDA wheels bring their own CUDA
# runtime libraries, so the runtime stage stays python-slim for both: GPU nodes provide only
# the driver (NVIDIA device plugin / container toolkit). Model weights are never baked in:
# pods fetch them into a cache volume at start (k8s/base/fetch_model.py).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_CUDA=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first, from the index of the chosen variant: `pip install .` then keeps it, since it
# satisfies the project's torch range.
RUN case "$VARIANT" in \
        cpu) index="$TORCH_INDEX_CPU" ;; \
        cuda) index="$TORCH_INDEX_CUDA" ;; \
        *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
    && pip install --index-url "$index" "torch==$TORCH_VERSION"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY orchestrator ./orchestrator
COPY bench ./bench
RUN pip install . \
    && tandem --help > /dev/null
# llama.cpp, for GGUF drafts and CPU targets (`--backend llama.cpp`, and `auto` for the
# built-in pair): llama-cpp-python built from source, for any x86-64 CPU (not this build
# machine's), on ggml's own thread pool (the Makefile says why). NOTE: a CPU build in both variants; ggml's CUDA kernels need the CUDA toolkit,
# which this python-slim stage lacks, so on GPU nodes --backend auto keeps both models on
# transformers (a CPU-only llama.cpp is never chosen for a --device other than cpu).
ARG LLAMA_CPP_VERSION=0.3.36
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && CMAKE_ARGS="-DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF" \
       pip install --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_VERSION" \
    && python -c "import llama_cpp" \
    && rm -rf /var/lib/apt/lists/*

FROM python:${PYTHON_VERSION}-slim AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="tandem" \
      org.opencontainers.image.description="Distributed lossless speculative decoding: draft, target and orchestrator services" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.tandem.variant="$VARIANT"
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid tandem --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin tandem \
    && mkdir /cache \
    && chown tandem:tandem /cache
COPY --from=build /opt/venv /opt/venv
# HOME and the caches point at volumes, so the root filesystem can be mounted read-only.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    TANDEM_CACHE_DIR=/cache \
    HF_HOME=/cache/huggingface \
    TANDEM_HOST=0.0.0.0
USER 10001:10001
# gRPC (services and health probes) and Prometheus metrics (--metrics-port).
EXPOSE 50051 9090
# Exec form: tandem is PID 1 and receives SIGTERM itself, which starts the graceful drain.
ENTRYPOINT ["tandem"]
CMD ["--help"]
