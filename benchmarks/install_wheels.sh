#!/usr/bin/env bash
# Installs the wheels in a local folder (no index, no network) into a target folder and prints
# the PYTHONPATH entry to use; for GPU machines that have torch but no DeepSpeed and no index.
#
#   eval "$(bash benchmarks/install_wheels.sh .whl /tmp/site)"   # sets PYTHONPATH
#
# Prepare the folder where pip reaches an index (the GPU machine runs Python 3.12 on x86-64):
#   DS_BUILD_OPS=0 python -m pip wheel deepspeed==0.19.8 --no-deps --no-build-isolation -w .whl
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 hjson annotated-types typing-inspection typing-extensions
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl torchft==0.2.0 \
#     opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
#     opentelemetry-exporter-otlp-proto-common opentelemetry-proto opentelemetry-semantic-conventions \
#     opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common \
#     googleapis-common-protos protobuf requests urllib3 certifi idna charset-normalizer
# (the versions test-torchft installs: `pip list` there; torchft is the GPU check's ddp_ft cell.
# DeepSpeed's other needs, einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo and tqdm,
# are on the GPU machine already; keep one version of each wheel in the folder.)
set -euo pipefail
WHEELS=${1:?usage: install_wheels.sh WHEEL_DIR [TARGET]}
TARGET=${2:-/tmp/site}
PY=${PYTHON:-python3}
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "install_wheels.sh: no wheels in '$WHEELS': build them as this script's header says." >&2; exit 2; }
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$WHEELS"/*.whl >&2
echo "export PYTHONPATH=\"$TARGET\${PYTHONPATH:+:\$PYTHONPATH}\""
