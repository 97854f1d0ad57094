#!/bin/bash
# Everything issue 23 measures on a lent GPU, in one call (device tool; $OUT comes back):
#   run(command="bash tools/bench/gpu/device_run.sh", carry=[".whl"], timeout_s=600)
# .whl: the pinned pure-Python stack and fla-core as wheels (tools/bench/gpu/NOTES.md lists them).
# A: the on-device kernel tests and two 50-step trainer runs (float32, bfloat16), side by side
#    (neither is timed); B, alone on the GPU: kernel benchmarks (GLA, KDA) and train-step MFU.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
LOG=$OUT/log.txt
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 ))s: $*"; }
stamp start; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,temperature.gpu --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
if ! python3 -c "import flax.nnx, optax, orbax.checkpoint, grain; from ling2.layers.model import Ling2Model" 2>"$OUT/import_err.txt"; then
  stamp "pinned flax/optax/orbax do not import with this jax; using the image's"; cat "$OUT/import_err.txt"
  rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $(ls .whl/*.whl | grep -vE '/(flax|optax|orbax_checkpoint)-') || exit 1
fi
python3 -c "import jax, jaxlib, flax, optax, orbax.checkpoint as o, torch, triton, fla; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__); print(jax.devices())"
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache

stamp "A: device tests and 50-step runs"
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 170 python3 -m pytest -q -p no:cacheprovider \
    ling2/kernels/gpu_device_test.py > "$OUT/device_test.txt" 2>&1; echo "pytest exit $?" >> "$OUT/device_test.txt" ) &
TESTS=$!
train() {  # dtype run_dir [extra key=value]
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 150 python3 -m ling2.train.train --run_dir="$2" --tensorboard=false \
    steps=50 log_period=1 eval_interval=50 checkpoint_period=50 dtype="$1" "${@:3}" > "$2.log" 2>&1
  echo "train $1 exit $?"; tail -4 "$2.log"
}
JAX_DEFAULT_MATMUL_PRECISION=highest train float32 /tmp/gpu_f32 & F32=$!
train bfloat16 /tmp/gpu_bf16 & BF16=$!
wait $F32 $BF16
python3 -m tools.bench.gpu.losses --ref tools/bench/gpu/losses_cpu_float32.json --run float32=/tmp/gpu_f32/metrics.jsonl \
  --run bfloat16=/tmp/gpu_bf16/metrics.jsonl --out "$OUT/losses.json"
wait $TESTS; stamp "A done"; tail -25 "$OUT/device_test.txt"

stamp "B: kernels"
timeout 100 python3 -m tools.bench.gpu.bench kernels --op gla --out "$OUT/gla.json"
stamp "B: kda"
timeout 120 python3 -m tools.bench.gpu.bench kernels --op kda --out "$OUT/kda.json"
stamp "B: train step"
timeout 140 python3 -m tools.bench.gpu.bench step --repeats 3 --out "$OUT/step.json"
stamp done
grep -hE "passed|failed|error" "$OUT/device_test.txt" | tail -3
python3 - "$OUT" <<'PY'
import json, os, sys
for name in ("gla", "kda", "step"):
    p = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(p):
        print(name, "missing"); continue
    d = json.load(open(p))
    for r in d["rows"]:
        print(name, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                     if k in ("T", "mode", "impl", "seconds", "ratio_vs_fla", "model", "tokens_per_s",
                              "mfu_vs_datasheet_peak", "mfu_vs_measured_matmul", "error")})
PY
