#!/bin/bash
# FP8 on one lent GPU, in one device-tool call ($OUT comes back):
#   run(command="bash tools/bench/fp8/device_run.sh", carry=[".whl"], timeout_s=590)
# .whl: the pure-Python packages the image lacks (tools/bench/gpu/NOTES.md). Phase 1, untimed, side by side:
# the fp8 unit tests on the GPU and 50 training steps of ling2-tiny with quantization=fp8 (tensor and block).
# Phase 2, alone on the GPU: tools/bench/fp8/gpu.py (compiled-step HLO, projection GEMMs, train steps).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 ))s: $*"; }
stamp start; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -vE '/(flax|optax|orbax_checkpoint|fla_core)-') || exit 1
export PYTHONPATH=/tmp/site:. JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
stamp "phase 1: fp8 unit tests and 50-step runs on the GPU"
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 170 python3 -m pytest -q -p no:cacheprovider ling2/layers/fp8_test.py \
    > "$OUT/fp8_test_gpu.txt" 2>&1; echo "pytest exit $?" >> "$OUT/fp8_test_gpu.txt" ) & PIDS=$!
for s in tensor block; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 timeout 170 python3 -m ling2.train.train --run_dir=/tmp/run_$s --tensorboard=false \
    steps=50 log_period=1 eval_interval=50 checkpoint_period=50 dtype=bfloat16 quantization=fp8 fp8_scaling=$s \
    > /tmp/run_$s.log 2>&1 & PIDS="$PIDS $!"
done
wait $PIDS  # by pid: a bare `wait` also waits for the log's tee
tail -3 "$OUT/fp8_test_gpu.txt"; tail -2 /tmp/run_*.log
python3 -m tools.bench.gpu.losses --ref tools/bench/gpu/losses_cpu_float32.json --run fp8=/tmp/run_tensor/metrics.jsonl \
  --run fp8-block=/tmp/run_block/metrics.jsonl --out "$OUT/losses_fp8.json"
stamp "phase 2: bench"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 330 python3 -m tools.bench.fp8.gpu --hlo_model ling2-tiny \
  --out "$OUT/results_gpu.json"
stamp done
