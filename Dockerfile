# Octavo on a CUDA machine. Build:  docker build -t octavo .
# Run the embedded tiny model:     docker run --gpus all -p 8000:8000 octavo
# Serve a model from a mounted Hugging Face cache (or any mounted folder):
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/models/hf -e HF_HUB_OFFLINE=1 \
#       octavo --model gpt2
#   docker run --gpus all -p 8000:8000 -v /path/to/gpt2:/models/gpt2 octavo --model /models/gpt2
# Stage 1: the wheel, built exactly as the packaging test builds the one it installs and
# serves (tests/packaging/test_wheel_install.py): pure Python, so any Python builds it.
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --no-cache-dir . -w /dist

# Stage 2: the runtime, with nothing of the source tree but that wheel.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/octavo/bin:$PATH \
    HF_HOME=/models/hf

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/octavo

# On this image PyPI's default torch wheel is the CUDA build, which is what we want here.
COPY --from=wheel /dist/ /tmp/dist/
RUN pip install --upgrade pip && pip install /tmp/dist/octavo-*.whl && rm -rf /tmp/dist

RUN useradd --create-home --uid 1000 octavo && mkdir -p /models && chown octavo /models
USER octavo
VOLUME ["/models"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1

# SIGTERM drains in-flight requests (--shutdown-grace-seconds) and exits 0.
ENTRYPOINT ["octavo", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
