#!/usr/bin/env bash
# Fills a folder (default .whl) with the wheels the GPU check installs with install_wheels.sh on a
# machine that has torch but no package index (the lent GPU machine: Python 3.12, x86-64): DeepSpeed
# (built here without its ops) and pydantic/hjson for it, torchao (the FP8 cell) and torchft with its
# OpenTelemetry dependencies (the ddp_ft cell). Run it where pip reaches PyPI, in an environment with
# torch (DeepSpeed's build imports it), then carry the folder with the device call:
#
#   hatch run test-torchft:bash benchmarks/prepare_wheels.sh [FOLDER]
#
# Keep one version of each wheel in the folder (start from an empty one).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python}
mkdir -p "$DIR"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" deepspeed==0.19.8
# Each wheel at the version this environment has (test-torchft's), else the newest.
WANTED=(pydantic pydantic-core hjson annotated-types typing-inspection typing-extensions torchao torchft
  opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
  opentelemetry-exporter-otlp-proto-common opentelemetry-proto opentelemetry-semantic-conventions
  opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common
  googleapis-common-protos protobuf requests urllib3 certifi idna charset-normalizer)
mapfile -t PINNED < <("$PY" - "${WANTED[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" "${PINNED[@]}"
du -sh "$DIR"
