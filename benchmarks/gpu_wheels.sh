#!/usr/bin/env bash
# Fetches, as wheels for the GPU machine (Python 3.12, x86-64, no package index there), the
# packages its image lacks that Octavo imports: the engine's (llguidance, msgspec, pyzmq:
# every gpu_session.sh stage needs them), the server's (the serve stage) and jsonschema's
# (the structured-output tests); and py-spy, the serve stage's profiler. Each at the version
# `make install` put in .venv, one version of each, so the GPU run uses what the CPU suite
# tested.
#
#   bash benchmarks/gpu_wheels.sh [DIR]     # DIR defaults to .whl (ignored by git)
#
# Then name DIR in the device call's `carry` and begin its command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit;
set -euo pipefail
dest=${1:-.whl}
python=${PYTHON:-.venv/bin/python}
packages=(
    llguidance msgspec pyzmq
    fastapi starlette uvicorn httptools pydantic pydantic-core annotated-types
    typing-inspection typing-extensions opentelemetry-api
    jsonschema jsonschema-specifications referencing rpds-py
    py-spy
)
# pip matches a manylinux tag exactly: offer every glibc level up to the GPU image's (2.39).
platforms=(--platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux2014_x86_64)
for minor in $(seq 17 39); do
    platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
pins=$("$python" - "${packages[@]}" <<'PY'
import importlib.metadata as metadata
import sys

print(" ".join(f"{name}=={metadata.version(name)}" for name in sys.argv[1:]))
PY
)
mkdir -p "$dest"
# shellcheck disable=SC2086  # one argument per pin
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dest" $pins
ls "$dest"
