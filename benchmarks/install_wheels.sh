#!/usr/bin/env bash
# Installs the wheels in a local folder (no index, no network) into a target folder and prints
# the PYTHONPATH entry to use; for GPU machines that have torch but no DeepSpeed and no index.
#
#   eval "$(bash benchmarks/install_wheels.sh .whl /tmp/site)"   # sets PYTHONPATH
#
# Prepare the folder where pip reaches an index: `hatch run test-torchft:bash
# benchmarks/prepare_wheels.sh .whl` (DeepSpeed, torchao, torchft and what they need that the GPU
# machine lacks; DeepSpeed's other needs, einops, msgpack, ninja, numpy, packaging, psutil,
# py-cpuinfo and tqdm, are on the GPU machine already).
set -euo pipefail
WHEELS=${1:?usage: install_wheels.sh WHEEL_DIR [TARGET]}
TARGET=${2:-/tmp/site}
PY=${PYTHON:-python3}
ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "install_wheels.sh: no wheels in '$WHEELS': build them as this script's header says." >&2; exit 2; }
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$WHEELS"/*.whl >&2
echo "export PYTHONPATH=\"$TARGET\${PYTHONPATH:+:\$PYTHONPATH}\""
