#!/usr/bin/env bash
# The GPU check, prepared to run unattended on a machine with an NVIDIA GPU in under 10 minutes
# (give the call timeout_s=600):
#   1. lite-cuda's tests, GPU tests included (the CPU ones run too: they take seconds);
#   2. the benchmark Lite vs plain PyTorch on a GPT-style model in bf16 (benchmarks/gpu_bench.py);
#   3. lite-deepspeed: its GPU tests (packages/lite-deepspeed/tests/test_gpu.py) and ZeRO 1-3 x
#      32-true/bf16-mixed against plain PyTorch plus Lite's step time against deepspeed.initialize
#      written by hand (benchmarks/gpu_deepspeed.py). DeepSpeed is installed from the wheels in
#      $DS_WHEELS (default .whl, carried with the call; benchmarks/prepare_wheels.sh fills it) when
#      it is not importable; without either, this part is skipped and says so;
#   4. model parallelism: ModelParallelStrategy over NCCL, dp1 x tp2 (dp2 x tp2 on 4 GPUs),
#      against one plain process, and a sharded checkpoint round trip
#      (benchmarks/gpu_model_parallel.py);
#   5. FP8 against bf16 on the GPT-style model at width 4096 (where FP8 pays), compiled: step-time
#      ratio, Lite's FP8 step against torchao by hand, and loss curves (benchmarks/gpu_fp8.py).
#      torchao is installed from the wheel in $DS_WHEELS when it is not importable; without
#      either, or below compute capability 8.9, it is skipped and says so;
#   6. context parallelism: ModelParallelStrategy(context_parallel_size=2) over NCCL, a causal
#      transformer on torch's ring attention against one plain process on whole sequences
#      (benchmarks/gpu_context_parallel.py; skipped on a CPU, where torch has no ring kernel);
#   7. the paths not yet run on a GPU (benchmarks/gpu_paths.py): a background save of CUDA tensors,
#      fsdp with a compiled model (the set-up model is the user's), ddp_ft with two replica groups
#      over torchft's NCCL process group (skipped without the torchft wheels in $DS_WHEELS), a
#      2-stage pipeline on NCCL.
#   8. expert parallelism: Lite's ExpertParallel step against the same MoE job written by hand
#      (distribute_tensor, all_to_all_single_autograd, fully_shard) over NCCL, bf16, torch._grouped_mm,
#      after a check that both give the same losses (benchmarks/expert_parallel.py).
#   9. a Mixture of Experts' grouped products on one GPU: bf16 torch._grouped_mm against a loop over
#      the experts, and FP8 rowwise (Float8Precision(experts="rowwise"), torchao's _scaled_grouped_mm)
#      against bf16 and against torchao by hand, whose losses it must equal (benchmarks/gpu_fp8_experts.py;
#      the FP8 arms need compute capability 9.0 and say so below it).
#   The two-rank cells (4, 6, 7's ddp_ft and pipeline, and 8) run on one GPU too: their two ranks
#   share it as two one-process nodes, each its own NCCL host (benchmarks/_two_ranks.py).
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]
#
# RESULTS_DIR defaults to $OUT/gpu_check when $OUT is set, else benchmarks/results/gpu_check. It
# receives machine.txt, tests.txt, bench.txt, gpu_bench.md/.json, deepspeed_tests.txt,
# deepspeed.txt, gpu_deepspeed.md/.json, model_parallel.txt, gpu_model_parallel.json, fp8.txt,
# gpu_fp8.md/.json, context_parallel.txt, gpu_context_parallel.json, paths.txt, gpu_paths.json,
# expert_parallel.txt, gpu_expert_parallel.md/.json, fp8_experts.txt, gpu_fp8_experts.json and
# summary.txt.
# Needs python (or $PYTHON) with a CUDA build of torch and pytest; pytest-timeout is optional.
# Installs nothing: when lite-core/lite-cuda are not installed, they are used from this checkout
# (benchmarks/_dev_site.py registers their entry points in a temporary folder).
# GPU_CHECK_DEVICE=cpu runs the same steps on a CPU (tiny benchmark), to test the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
RESULTS=${1:-${OUT:+$OUT/gpu_check}}
RESULTS=${RESULTS:-benchmarks/results/gpu_check}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)

DS_WHEELS=${DS_WHEELS:-.whl}
if ! "$PY" -c "import deepspeed, torchao, torchft" 2>/dev/null && ls "$DS_WHEELS"/*.whl >/dev/null 2>&1; then
  eval "$(bash benchmarks/install_wheels.sh "$DS_WHEELS" /tmp/lite_ds_site)" || exit 3
fi
if ! "$PY" -c "import importlib.metadata as m; m.distribution('lite-core'); m.distribution('lite-cuda'); m.distribution('lite-deepspeed'); m.distribution('lite-torchft')" 2>/dev/null; then
  SITE=$(mktemp -d)
  trap 'rm -rf "$SITE"' EXIT
  "$PY" benchmarks/_dev_site.py "$SITE" packages/lite-core packages/lite-cuda packages/lite-deepspeed packages/lite-torchft >/dev/null || exit 3
  export PYTHONPATH="$SITE:$PWD/packages/lite-core/src:$PWD/packages/lite-cuda/src:$PWD/packages/lite-deepspeed/src:$PWD/packages/lite-torchft/src${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv 2>&1 || echo "nvidia-smi: not available"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$RESULTS/machine.txt" 2>&1
cat "$RESULTS/machine.txt"

PYTEST_ARGS=(packages/lite-cuda/tests -p no:cacheprovider -rs)
if ! "$PY" -c "import pytest_timeout" 2>/dev/null; then
  # pytest.ini asks for --strict-markers and per-test timeouts; without the plugin, drop both
  # and bound the whole run with `timeout` instead.
  PYTEST_ARGS+=(-o "addopts=--import-mode=importlib -ra")
fi
echo "== tests (at most 150 s)"
timeout -k 5 150 "$PY" -m pytest "${PYTEST_ARGS[@]}" > "$RESULTS/tests.txt" 2>&1
TESTS_RC=$?
tail -n 25 "$RESULTS/tests.txt"

BENCH_ARGS=(--device "$DEVICE" --out "$RESULTS/gpu_bench")
[ "$DEVICE" = cpu ] && BENCH_ARGS+=(--quick)
echo "== benchmark (at most 150 s)"
timeout -k 5 150 "$PY" benchmarks/gpu_bench.py "${BENCH_ARGS[@]}" > "$RESULTS/bench.txt" 2>&1
BENCH_RC=$?
cat "$RESULTS/bench.txt"

if "$PY" -c "import deepspeed" 2>/dev/null; then
  DS_ARGS=(--device "$DEVICE" --out "$RESULTS/gpu_deepspeed")
  [ "$DEVICE" = cpu ] && DS_ARGS+=(--quick)
  echo "== lite-deepspeed GPU tests (at most 90 s)"
  timeout -k 5 90 "$PY" -m pytest packages/lite-deepspeed/tests/test_gpu.py "${PYTEST_ARGS[@]:1}" > "$RESULTS/deepspeed_tests.txt" 2>&1
  DS_TESTS_RC=$?
  tail -n 12 "$RESULTS/deepspeed_tests.txt"
  echo "== lite-deepspeed: ZeRO 1-3 vs plain PyTorch, step time vs deepspeed.initialize (at most 150 s)"
  timeout -k 5 150 "$PY" benchmarks/gpu_deepspeed.py "${DS_ARGS[@]}" > "$RESULTS/deepspeed.txt" 2>&1
  DS_RC=$?
  grep -E "^ZeRO|Error|error" "$RESULTS/deepspeed.txt" | tail -n 20
else
  echo "== lite-deepspeed: skipped, deepspeed is not importable and $DS_WHEELS holds no deepspeed wheel"
  DS_TESTS_RC=0 DS_RC=0
fi

# run_entry TITLE SECONDS LOG PATTERN SCRIPT ARGS...: runs `$PY SCRIPT ARGS...` for at most SECONDS,
# its output into LOG, and shows LOG's last lines matching PATTERN; returns the script's exit code.
run_entry() {
  local title=$1 seconds=$2 log=$3 pattern=$4
  shift 4
  echo "== $title (at most $seconds s)"
  timeout -k 5 "$seconds" "$PY" "$@" > "$log" 2>&1
  local rc=$?
  grep -E "$pattern" "$log" | tail -n 10
  return $rc
}

run_entry "model parallel" 120 "$RESULTS/model_parallel.txt" "^model parallel|Error" \
  benchmarks/gpu_model_parallel.py --device "$DEVICE" --out "$RESULTS/gpu_model_parallel.json"
MP_RC=$?

if "$PY" -c "import torchao" 2>/dev/null; then
  FP8_ARGS=(--device "$DEVICE" --out "$RESULTS/gpu_fp8")
  [ "$DEVICE" = cpu ] && FP8_ARGS+=(--quick)
  echo "== FP8 against bf16 (at most 180 s)"
  timeout -k 5 180 "$PY" benchmarks/gpu_fp8.py "${FP8_ARGS[@]}" > "$RESULTS/fp8.txt" 2>&1
  FP8_RC=$?
  grep -E "^\||^fp8|Error" "$RESULTS/fp8.txt" | tail -n 12
else
  echo "== FP8: skipped, torchao is not importable and $DS_WHEELS holds no torchao wheel" | tee "$RESULTS/fp8.txt"
  FP8_RC=0
fi

run_entry "context parallel" 90 "$RESULTS/context_parallel.txt" "^context parallel|Error" \
  benchmarks/gpu_context_parallel.py --out "$RESULTS/gpu_context_parallel.json"
CP_RC=$?

run_entry "paths not yet run on a GPU" 240 "$RESULTS/paths.txt" "^gpu paths|Error" \
  benchmarks/gpu_paths.py --device "$DEVICE" --out "$RESULTS/gpu_paths.json"
PATHS_RC=$?

EP_ARGS=(--device "$DEVICE" --out "$RESULTS/gpu_expert_parallel" --quick)
[ "$DEVICE" = cpu ] && EP_ARGS=(--device cpu --out "$RESULTS/gpu_expert_parallel" --smoke --gpu-style)
run_entry "expert parallel, Lite vs by hand" 150 "$RESULTS/expert_parallel.txt" "^expert parallel|FAILED|MISMATCH" \
  benchmarks/expert_parallel.py "${EP_ARGS[@]}"
EP_RC=$?

FP8E_ARGS=(--device "$DEVICE" --out "$RESULTS/gpu_fp8_experts.json")
[ "$DEVICE" = cpu ] && FP8E_ARGS+=(--smoke)
run_entry "experts' grouped products, bf16 and FP8" 90 "$RESULTS/fp8_experts.txt" "^fp8 experts|Error" \
  benchmarks/gpu_fp8_experts.py "${FP8E_ARGS[@]}"
FP8E_RC=$?

{
  echo "tests: exit $TESTS_RC ($(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^=]*' "$RESULTS/tests.txt" | tail -n 1))"
  echo "benchmark: exit $BENCH_RC"
  echo "deepspeed tests: exit $DS_TESTS_RC ($(grep -Eo '[0-9]+ (passed|failed|skipped|error)[^=]*' "$RESULTS/deepspeed_tests.txt" 2>/dev/null | tail -n 1))"
  echo "deepspeed parity and step time: exit $DS_RC"
  echo "model parallel: exit $MP_RC ($(grep -E '^model parallel' "$RESULTS/model_parallel.txt" | tail -n 1))"
  echo "fp8: exit $FP8_RC ($(grep -E '^\| fp8 / bf16|^fp8: skipped|^== FP8: skipped' "$RESULTS/fp8.txt" | tail -n 1))"
  echo "context parallel: exit $CP_RC ($(grep -E '^context parallel' "$RESULTS/context_parallel.txt" | tail -n 1))"
  echo "gpu paths: exit $PATHS_RC ($(grep -cE '^gpu paths .*: ok' "$RESULTS/paths.txt") ok, $(grep -cE '^gpu paths .*: skipped' "$RESULTS/paths.txt") skipped)"
  echo "expert parallel: exit $EP_RC ($(grep -E '^expert parallel' "$RESULTS/expert_parallel.txt" | tail -n 1))"
  echo "fp8 experts: exit $FP8E_RC ($(grep -E '^fp8 experts' "$RESULTS/fp8_experts.txt" | tail -n 1))"
} > "$RESULTS/summary.txt"
cat "$RESULTS/summary.txt"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$DS_TESTS_RC" -eq 0 ] && [ "$DS_RC" -eq 0 ] && [ "$MP_RC" -eq 0 ] && [ "$FP8_RC" -eq 0 ] && [ "$CP_RC" -eq 0 ] && [ "$PATHS_RC" -eq 0 ] && [ "$EP_RC" -eq 0 ] && [ "$FP8E_RC" -eq 0 ]
