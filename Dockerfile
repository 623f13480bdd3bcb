# Octavo on a CUDA machine. Build:  docker build -t octavo .
# Run the embedded tiny model:     docker run --gpus all -p 8000:8000 octavo
# Serve a model from a mounted Hugging Face cache (or any mounted folder):
#   docker run --gpus all -p 8000:8000 -v ~/.cache/huggingface:/models/hf -e HF_HUB_OFFLINE=1 \
#       octavo --model gpt2
#   docker run --gpus all -p 8000:8000 -v /path/to/gpt2:/models/gpt2 octavo --model /models/gpt2
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

WORKDIR /opt/octavo/src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY server ./server
# On this image PyPI's default torch wheel is the CUDA build, which is what we want here.
RUN pip install --upgrade pip && pip install .

RUN useradd --create-home --uid 1000 octavo && mkdir -p /models && chown octavo /models
USER octavo
VOLUME ["/models"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/health || exit 1

# SIGTERM drains in-flight requests (--shutdown-grace-seconds) and exits 0.
ENTRYPOINT ["octavo", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
