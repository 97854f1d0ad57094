#!/bin/bash
# The second device call of issue 23 (after device_run.sh found KDA's Pallas GPU kernels 59x slower than
# fla and the MoE step out of memory): the restructured KDA kernels and the blocked grouped matmul.
#   run(command="bash tools/bench/gpu/device_followup.sh", carry=[".whl"], timeout_s=260)
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 ))s: $*"; }
stamp start; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
# The image's flax/optax/orbax (jax 0.11.2's); the pinned flax 0.12.8 does not import with it.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  $(ls .whl/*.whl | grep -vE '/(flax|optax|orbax_checkpoint)-') || exit 1
export PYTHONPATH=/tmp/site:. JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 timeout 110 python3 -m pytest -q -p no:cacheprovider -k "kda or auto" \
    ling2/kernels/gpu_device_test.py > "$OUT/device_test.txt" 2>&1; echo "pytest exit $?" >> "$OUT/device_test.txt" ) &
TESTS=$!
XLA_PYTHON_CLIENT_MEM_FRACTION=0.7 timeout 140 python3 -m tools.bench.gpu.bench step --repeats 3 --out "$OUT/step.json"
wait $TESTS; stamp "tests done"; tail -30 "$OUT/device_test.txt"
timeout 70 python3 -m tools.bench.gpu.bench kernels --op kda --ts 4096,16384 --impls pallas_gpu,fla_chunk_kda,fla_chunk_kda_safe_gate --out "$OUT/kda.json"
stamp "kda done"
timeout 60 python3 -m tools.bench.gpu.bench kernels --op gla --ts 16384,32768 --impls pallas_gpu,fla_chunk_simple_gla,cudnn_attention --out "$OUT/gla.json"
stamp done
