#!/bin/bash
# Issue 23's measurements on one lent GPU, in one device-tool call ($OUT comes back):
#   run(command="bash tools/bench/gpu/device_run.sh", carry=[".whl"], timeout_s=560)
#   run(command="bash tools/bench/gpu/device_run.sh losses", ...)   # the 50-step runs against CPU float32
# .whl: fla-core and the pure-Python packages the image lacks (NOTES.md). Phase 1 runs nothing timed, side by
# side: the device tests, the train steps' compiles and the kernels' first calls (fla's autotuning), filling JAX's
# persistent cache and Triton's autotuning cache. Phase 2, alone on the GPU: the timed step and kernel rows.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 ))s: $*"; }
stamp start; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
if ! python3 -c "import flax.nnx, optax, orbax.checkpoint, grain; from ling2.layers.model import Ling2Model" 2>"$OUT/import_err.txt"; then
  stamp "pinned flax/optax/orbax do not import with this jax; using the image's"; tail -1 "$OUT/import_err.txt"
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls .whl/*.whl | grep -vE '/(flax|optax|orbax_checkpoint)-') || exit 1
fi
python3 -c "import jax, flax, torch, triton, fla; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, jax.devices())"
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache XLA_PYTHON_CLIENT_PREALLOCATE=false
GLA_IMPLS=pallas_gpu,pallas_gpu_bv32,cudnn_attention,fla_chunk_simple_gla  # fla's backward refuses Triton < 3.7.1 on Hopper
KDA_IMPLS=pallas_gpu,pallas_gpu_bv32,pallas_gpu_prologue_only,fla_chunk_kda,fla_chunk_kda_safe_gate
bench() { python3 -m tools.bench.gpu.bench "$@"; }

if [ "${1:-}" = losses ]; then
  train() {  # dtype run_dir
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 150 python3 -m ling2.train.train --run_dir="$2" --tensorboard=false \
      steps=50 log_period=1 eval_interval=50 checkpoint_period=50 dtype="$1" > "$2.log" 2>&1
    echo "train $1 exit $?"; tail -3 "$2.log"
  }
  JAX_DEFAULT_MATMUL_PRECISION=highest train float32 /tmp/gpu_f32 & F32=$!
  train bfloat16 /tmp/gpu_bf16; wait $F32
  python3 -m tools.bench.gpu.losses --ref tools/bench/gpu/losses_cpu_float32.json \
    --run float32=/tmp/gpu_f32/metrics.jsonl --run bfloat16=/tmp/gpu_bf16/metrics.jsonl --out "$OUT/losses.json"
  exit
fi

stamp "phase 1: device tests, step compiles, kernel warm-ups (untimed, side by side)"
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout 200 python3 -m pytest -q -p no:cacheprovider \
    ling2/kernels/gpu_device_test.py ling2/layers/attention_mla_gpu_device_test.py > "$OUT/device_test.txt" 2>&1
  echo "pytest exit $?" >> "$OUT/device_test.txt" ) & PIDS=$!
for m in ling2-small ling3-small; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout 200 python3 -m tools.bench.gpu.bench step --compile_only --models $m \
    --out /tmp/compile_$m.json > /tmp/compile_$m.log 2>&1 & PIDS="$PIDS $!"
done
XLA_PYTHON_CLIENT_MEM_FRACTION=0.08 timeout 200 python3 -m tools.bench.gpu.bench kernels --op gla --warm \
  --impls $GLA_IMPLS --out /tmp/gla_warm.json > /tmp/gla_warm.log 2>&1 & PIDS="$PIDS $!"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout 200 python3 -m tools.bench.gpu.bench kernels --op kda --warm \
  --impls $KDA_IMPLS --out /tmp/kda_warm.json > /tmp/kda_warm.log 2>&1 & PIDS="$PIDS $!"
wait $PIDS  # by pid: a bare `wait` also waits for the log's tee (a process substitution) and never returns
stamp "phase 1 done"; tail -n 4 /tmp/compile_*.log /tmp/*_warm.log; grep -E "passed|failed|exit" "$OUT/device_test.txt" | tail -3

stamp "phase 2: train steps"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 130 python3 -m tools.bench.gpu.bench step --repeats 10 --out "$OUT/step.json"
stamp "phase 2: gla"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 90 python3 -m tools.bench.gpu.bench kernels --op gla --impls $GLA_IMPLS --out "$OUT/gla.json"
stamp "phase 2: kda"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout 90 python3 -m tools.bench.gpu.bench kernels --op kda --impls $KDA_IMPLS --out "$OUT/kda.json"
stamp done
cp /tmp/compile_ling2-small.json /tmp/compile_ling3-small.json "$OUT/" 2>/dev/null
python3 - "$OUT" <<'PY'
import json, os, sys
for name in ("gla", "kda", "step"):
    p = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(p):
        print(name, "missing"); continue
    for r in json.load(open(p))["rows"]:
        print(name, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                     if k in ("T", "mode", "impl", "seconds", "ratio_vs_fla", "model", "attention_kernel", "step_s",
                              "tokens_per_s", "mfu_vs_datasheet_peak", "mfu_vs_measured_matmul", "error")})
PY
