#!/bin/bash
# Issue 36's measurements on one lent GPU in one device-tool call ($OUT comes back):
#   run(command="bash tools/bench/gpu/device_run.sh", carry=[".whl", ".base"], timeout_s=570)
# .whl: the packages the image lacks (pydantic, grain, fla-core and their missing dependencies), fetched here by
# tools/bench/gpu/fetch_wheels.sh. .base: `git archive` of the commit to compare against (baseline rows run from it), optional.
# LING2_FROM_BASE: paths the new rows take from .base (work in progress left out of a run).
# Phases (PHASES, run in the order given; default below): test (device correctness tests, beside the warm
# compiles), warm (every step's compile, side by side, into JAX's persistent cache), step (timed steps + traces),
# mfu (the three MFU figures), moe (the grouped SwiGLU alone per backend), kernels (GLA and KDA vs fla, device-bound),
# attn (MLA's cuDNN attention alone: the packed-document mask and the 192-wide heads, tools/bench/gpu/attention.py).
# Each phase is under `timeout`; results are
# packed into $OUT/results.tar.gz (raw traces the reader could not read: traces.tar.gz) after every phase, so a
# run cut short keeps what it measured.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"; R=/tmp/results; mkdir -p $R
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s); stamp() { echo "== $(( $(date +%s) - T0 ))s: $*"; }
pack() { tar -czf "$OUT/results.tar.gz" -C $R . 2>/dev/null
        [ -d /tmp/raw ] && tar -czf "$OUT/traces.tar.gz" -C /tmp/raw . 2>/dev/null; }
PHASES=${PHASES:-test,warm,kernels,step,moe,mfu}
stamp start; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # Triton >= 3.3 keeps autotuning picks on disk: fla tunes in warm, not in kernels
python3 -c "import jax, flax, torch, triton, fla; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, jax.devices())" | tee $R/versions.txt
NEW=$PWD
if [ -n "${LING2_FROM_BASE:-}" ] && [ -d .base ]; then
  NEW=/tmp/new; mkdir -p $NEW; tar -c --exclude=./.base --exclude=./.whl . | tar -x -C $NEW
  for p in $LING2_FROM_BASE; do rm -rf "$NEW/$p"; cp -r ".base/$p" "$NEW/$p"; done
fi
if [ -d .base ]; then  # the baseline's ling2/ and configs/ under this tree's benchmark harness (tools/)
  BASE=/tmp/base; mkdir -p $BASE; cp -r .base/. $BASE/; rm -rf $BASE/tools; cp -r tools $BASE/tools
fi
new() { (cd $NEW && PYTHONPATH=/tmp/site:$NEW "$@"); }
base() { (cd $BASE && PYTHONPATH=/tmp/site:$BASE "$@"); }
STEP_NEW=${STEP_NEW:-"ling2-small:attention_kernel=cudnn ling2-1gpu ling2-1gpu:moe_gmm_backend=blocked"}
STEP_BASE=${STEP_BASE-"ling2-small:attention_kernel=cudnn"}  # set empty: no baseline rows
BATCH=${BATCH:-8}; BATCH_1GPU=${BATCH_1GPU:-4}
batch() { case $1 in *1gpu*) echo $BATCH_1GPU;; *) echo $BATCH;; esac; }
stepb() {  # new|base spec mem_fraction seconds extra-args...
  local who=$1 spec=$2 frac=$3 secs=$4; shift 4
  $who env XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout $secs python3 -m tools.bench.gpu.bench step --models "$spec" \
    --attention_kernels "" --batch $(batch $spec) "$@"
}

TEST_PID=""
phase_test() {  # beside the warm compiles: the device tests take little of the GPU
  stamp "phase test"
  ( new timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider \
      ${TESTS:-ling2/kernels/moe/gpu_device_test.py ling2/kernels/gpu_device_test.py ling2/kernels/attention/cudnn_gpu_device_test.py} \
      > $R/device_test.txt 2>&1
    echo "pytest exit $?" >> $R/device_test.txt ) & TEST_PID=$!
}
phase_warm() {
  stamp "phase warm: compiles side by side"; PIDS=""
  for s in $STEP_NEW; do
    stepb new "$s" ${WARM_FRAC:-0.1} ${WARM_S:-200} --compile_only --out /tmp/compile_new_${s//[:=]/_}.json > /tmp/compile_new_${s//[:=]/_}.log 2>&1 & PIDS="$PIDS $!"
  done
  if [[ ",$PHASES," == *,kernels,* ]]; then for op in gla kda; do  # fla's autotuning, before its timed phase
    new env XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout ${WARM_S:-200} python3 -m tools.bench.gpu.bench kernels --op $op \
      --impls ${KERNEL_WARM_IMPLS:-fla_chunk_simple_gla,fla_chunk_kda} --ts ${KERNEL_TS:-4096,16384,32768} --warm \
      --out /tmp/warm_$op.json > /tmp/warm_kernels_$op.log 2>&1 & PIDS="$PIDS $!"
  done; fi
  if [ -d .base ]; then for s in $STEP_BASE; do
    stepb base "$s" ${WARM_FRAC:-0.1} ${WARM_S:-200} --compile_only --out /tmp/compile_base_${s//[:=]/_}.json > /tmp/compile_base_${s//[:=]/_}.log 2>&1 & PIDS="$PIDS $!"
  done; fi
  wait $PIDS $TEST_PID; TEST_PID=""
  tail -n 2 /tmp/compile_*.log /tmp/warm_kernels_*.log 2>/dev/null; cp /tmp/compile_*.log /tmp/warm_kernels_*.log $R/ 2>/dev/null; pack
}
phase_step() {
  stamp "phase step"
  if [ -d .base ]; then for s in $STEP_BASE; do
    stepb base "$s" 0.9 ${STEP_S:-100} --repeats 5 --trace /tmp/trace_base --out $R/step_base_${s//[:=]/_}.json
  done; fi
  for s in $STEP_NEW; do stepb new "$s" 0.9 ${STEP_S:-100} --repeats 5 --trace /tmp/trace_new --out $R/step_new_${s//[:=]/_}.json; done
  for d in /tmp/trace_base/* /tmp/trace_new/*; do
    [ -d "$d" ] || continue; n=$(basename $(dirname $d))_$(basename $d)
    if [ ! -f tools/bench/gpu/trace.py ]; then
      mkdir -p /tmp/raw/$n; find $d -name '*.xplane.pb' -exec cp {} /tmp/raw/$n/ \; ; continue
    fi
    new timeout 60 python3 -m tools.bench.gpu.trace "$d" --steps 3 --csv $R/$n.csv --json $R/$n.json --top 25 \
      > $R/$n.txt 2>&1 || { echo "trace reader failed on $d"; tail -3 $R/$n.txt;
                            mkdir -p /tmp/raw/$n; find $d -name '*.xplane.pb' -exec cp {} /tmp/raw/$n/ \; ; }
    head -40 $R/$n.txt
  done
  pack
}
phase_mfu() {
  stamp "phase mfu"
  for m in ${MFU_MODELS:-"ling2-1gpu:ling2"}; do
    new env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout ${MFU_S:-420} python3 -m tools.bench.gpu.mfu --model ${m%%:*} \
      --full_model ${m##*:} --batch $BATCH_1GPU --seq 4096 --repeats 5 --out $R/mfu_${m%%:*}.json
  done
  pack
}
phase_moe() {
  stamp "phase moe"
  new env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout ${MOE_S:-120} python3 -m tools.bench.gpu.moe --out $R/moe.json \
    ${MOE_ARGS:-}; pack
}
phase_attn() {
  stamp "phase attn"
  new env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout ${ATTN_S:-90} python3 -m tools.bench.gpu.attention --out $R/attention.json \
    ${ATTN_ARGS:-}; pack
}
phase_kernels() {
  stamp "phase kernels"
  for op in gla kda; do
    new env XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 timeout ${KERNEL_S:-120} python3 -m tools.bench.gpu.bench kernels --op $op \
      --impls ${KERNEL_IMPLS:-pallas_gpu,fla_chunk_simple_gla,fla_chunk_kda} --ts ${KERNEL_TS:-4096,16384,32768} --out $R/$op.json
  done
  pack
}
for p in ${PHASES//,/ }; do
  declare -F phase_$p > /dev/null || { echo "unknown phase $p (test, warm, step, mfu, moe, kernels, attn)"; exit 2; }
  phase_$p
done
[ -n "$TEST_PID" ] && wait $TEST_PID; tail -3 $R/device_test.txt 2>/dev/null
stamp done
pack; ls -la $R
