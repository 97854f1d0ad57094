"""GPU benchmarks on one NVIDIA GPU: the linear-attention kernels against flash-linear-attention's Triton
ops and cuDNN attention, and the train step's tokens/s and MFU. Needs a GPU; writes JSON.

  python -m tools.bench.gpu.bench kernels --op gla --out gla.json   # or --op kda
  python -m tools.bench.gpu.bench step --out step.json

kernels: B=2, H=16, K=V=128, bf16, at each --ts; forward and forward+backward of Ling2's Pallas GPU
  kernel (`pallas_gpu`), its pure-JAX chunked form (`chunked`), fla's Triton op (`chunk_simple_gla` /
  `chunk_kda`, torch, from the fla-core wheel; for KDA also with `safe_gate=True, lower_bound=-5`, the
  bounded gate Ling 3 uses), and causal softmax attention through cuDNN
  (`jax.nn.dot_product_attention(implementation="cudnn")`, the same B, H, D: the MLA-layer cost a
  linear layer replaces). Times are device-bound: per call, the median over --repeats batches of 10
  calls queued back to back and synchronised once, after a warm-up. Backward is with respect to every input fla differentiates (GLA: q, k, v; KDA: q, k,
  v, g, beta).
step: ling2-small and ling3-small train steps (jitted gradient of the training objective: main CE +
  MoE aux + MTP; tools/bench/step) at --seq, --batch rows, bf16 compute. MFU = tokens/s x Ling2's
  own training FLOPs per token (`training_flops_per_token`) over the chip's dense bf16 peak
  (datasheet) and over a bf16 8192^3 matmul timed in the same run.
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ling2.kernels.testing import fla_reference  # fla-core's Triton ops (torch), test-only
from tools.bench.report import host_facts, matmul_rate

# Dense bf16 tensor-core peak without sparsity (NVIDIA H100 SXM / H200 datasheets: 989.4 TFLOP/s).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


CALLS = 10  # calls queued per timed batch


def _median_seconds(run, repeats):
    """Device-bound seconds per call: run(n) queues n calls and synchronises once (host dispatch hides behind
    the device's work, as in `tools.bench.report.queued_seconds`); the median of `repeats` batches."""
    run(1)  # warm-up (compiled already; autotuning for fla)
    if not repeats:
        return None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(CALLS)
        times.append((time.perf_counter() - t0) / CALLS)
    return float(np.median(times))


def _jax_runner(fn, args):
    """run(n): n calls of the compiled fn, synchronised once."""
    compiled = jax.jit(fn).lower(*args).compile()

    def run(n):
        out = None
        for _ in range(n):
            out = compiled(*args)
        jax.block_until_ready(out)

    return run


def _inputs(op, B, T, H, D, seed=0):
    """fp32 numpy inputs: GLA q, k, v and a per-head decay as [B, T, H]; KDA L2-normed q, k, v, gates in
    (-5, 0) and beta."""
    r = np.random.default_rng(seed)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    sig = lambda x: 1 / (1 + np.exp(-x))
    if op == "gla":
        q, k, v = (r.standard_normal((B, T, H, D), np.float32) * 0.1 for _ in range(3))
        g_BTH = np.broadcast_to(-(2.0 ** (-0.5 * (np.arange(H) + 1))), (B, T, H)).astype(np.float32)
        return {"q": q, "k": k, "v": v, "g": g_BTH}
    q, k = (l2(r.standard_normal((B, T, H, D), np.float32)) for _ in range(2))
    v = r.standard_normal((B, T, H, D), np.float32)
    g = (-5 * sig(r.standard_normal((B, T, H, D), np.float32) - 3)).astype(np.float32)
    beta = sig(r.standard_normal((B, T, H), np.float32)).astype(np.float32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def _ling2_runner(op, backend, mode, x):
    from ling2.kernels import gla, kda

    bf = jnp.bfloat16
    if op == "gla":
        args = [jnp.asarray(x[n], bf) for n in "qkv"] + [jnp.asarray(x["g"][0, 0])]  # per-head decay [H]
        f = lambda q, k, v, g: gla.simple_gla(q, k, v, g, backend=backend)
        argnums = (0, 1, 2)
    else:
        args = [jnp.asarray(x[n], bf) for n in "qkv"] + [jnp.asarray(x["g"]), jnp.asarray(x["beta"])]
        f = lambda q, k, v, g, beta: kda.kda(q, k, v, g, beta, backend=backend)
        argnums = (0, 1, 2, 3, 4)
    if mode == "fwd":
        return _jax_runner(f, args)
    return _jax_runner(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=argnums), args)


def _kda_prologue_runner(x):
    """KDA forward's state-independent part alone (padding, chunking, the batched XLA prologue and the
    sweep operands of kda_pallas_gpu): the part outside the Triton sweeps."""
    from ling2.kernels import kda, layout
    from ling2.kernels.kda import pallas_gpu as kda_pallas_gpu

    def f(q, k, v, g, beta):
        C = 64
        args = [layout.prepare(t, C) for t in (q, k, v, g)] + [kda.prepare_beta(beta, C)]
        aux = kda.prepare_docs(jnp.zeros(q.shape[:2], jnp.int32), C)
        return kda_pallas_gpu._sweep_inputs(*args, aux, q.shape[-1] ** -0.5, C)[2]

    return _jax_runner(f, [jnp.asarray(x[n], jnp.bfloat16) for n in "qkv"] + [jnp.asarray(x["g"]), jnp.asarray(x["beta"])])


def _module(op):
    from ling2.kernels.gla import pallas_gpu as gla_pallas_gpu
    from ling2.kernels.kda import pallas_gpu as kda_pallas_gpu

    return {"gla": gla_pallas_gpu, "kda": kda_pallas_gpu}[op]


def _knob(op, name):
    return getattr(_module(op), name)


def _with_knobs(op, make, **knobs):
    """make() with module constants of the op's Pallas GPU kernels (BLOCK_V, STATE_DTYPE, SWEEP_STAGES, ...) set
    while it traces: a variant to time beside the default."""
    mod = _module(op)

    def wrapped():
        old = {k: getattr(mod, k) for k in knobs}
        for k, v in knobs.items():
            setattr(mod, k, v)
        try:
            return make()
        finally:
            for k, v in old.items():
                setattr(mod, k, v)

    return wrapped


def _cudnn_runner(mode, x):
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in "qkv")
    att = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if mode == "fwd":
        return _jax_runner(att, (q, k, v))
    return _jax_runner(jax.grad(lambda *a: jnp.sum(att(*a).astype(jnp.float32)), argnums=(0, 1, 2)), (q, k, v))


def kernels(args, save):
    """Rows of every (T, mode, impl); `save(rows)` after each, so a run cut short keeps what it measured."""
    B, H, D = 2, 16, 128
    fla_name = {"gla": "fla_chunk_simple_gla", "kda": "fla_chunk_kda"}[args.op]
    rows = []
    for T in args.ts:
        x = _inputs(args.op, B, T, H, D)
        for mode in args.modes:
            pallas = lambda: _ling2_runner(args.op, "pallas_gpu", mode, x)
            makers = {"pallas_gpu": pallas,
                      "pallas_gpu_bv32": _with_knobs(args.op, pallas, BLOCK_V=32),
                      "chunked": lambda: _ling2_runner(args.op, "chunked", mode, x),
                      "cudnn_attention": lambda: _cudnn_runner(mode, x),
                      fla_name: lambda: fla_reference.chunk_op_runner(args.op, mode, x)}
            for stages in sorted({1, 2, 3, 4} - {_knob(args.op, "SWEEP_STAGES")}):  # the sweeps' pipeline depth
                makers[f"pallas_gpu_sweep{stages}"] = _with_knobs(args.op, pallas, SWEEP_STAGES=stages)
            if args.op == "gla":  # the stored chunk states in fp32 (the earlier default); smaller sweep state blocks
                makers["pallas_gpu_f32states"] = _with_knobs(args.op, pallas, STATE_DTYPE=jnp.float32)
                makers["pallas_gpu_sweep_v32"] = _with_knobs(args.op, pallas, SWEEP_BLOCK_V=32)
                makers["pallas_gpu_sweep_kv32"] = _with_knobs(args.op, pallas, SWEEP_BLOCK_K=32, SWEEP_BLOCK_V=32)
                makers["pallas_gpu_chunk_v128"] = _with_knobs(args.op, pallas, BLOCK_V=128)  # q, k read once
            if args.op == "kda":  # Ling 3's gates are bounded (-5, 0): fla's safe-gate path applies
                makers[fla_name + "_safe_gate"] = lambda: fla_reference.chunk_op_runner(args.op, mode, x, safe_gate=True,
                                                                                      lower_bound=-5.0)
                makers["pallas_gpu_prologue3"] = _with_knobs(args.op, pallas, PROLOGUE_STAGES=3)  # its key loops pipelined
                makers["pallas_gpu_xla_grads"] = _with_knobs(args.op, pallas, GRAD_KERNELS=False)  # the gradients batched
                if mode == "fwd":
                    makers["pallas_gpu_prologue_only"] = lambda: _kda_prologue_runner(x)
            for impl, make in makers.items():
                if args.impls and impl not in args.impls:
                    continue
                row = {"op": args.op, "T": T, "mode": mode, "impl": impl}
                try:
                    t0 = time.perf_counter()
                    run = make()
                    row["compile_seconds"] = time.perf_counter() - t0
                    row["seconds"] = _median_seconds(run, 0 if args.warm else args.repeats)
                except Exception as e:  # noqa: BLE001 - a failing implementation is a result, recorded
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                rows.append(row)
                save(rows)
                print(f"{args.op} T={T:>6} {mode:>8} {impl:>24} "
                      + (f"ERROR {row['error'][:160]}" if "error" in row else "warm" if args.warm
                         else f"{row['seconds'] * 1e3:9.2f} ms"), flush=True)
    return rows


def with_ratios(rows, fla_name):
    for r in rows:
        ref = next((s for s in rows if s["T"] == r["T"] and s["mode"] == r["mode"] and s["impl"] == fla_name), None)
        if ref and ref.get("seconds") and r.get("seconds"):
            r["ratio_vs_fla"] = r["seconds"] / ref["seconds"]
    return rows


def _variant(spec: str):
    """"model[:key=value...]" -> (model, {key: value}, label); values parsed as YAML, as config overrides are."""
    import yaml

    model, *kvs = spec.split(":")
    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in kvs)}
    return model, overrides, spec.replace(":", "_").replace("=", "-")


def step(args, save):
    from tools.bench.step import bench as step_bench

    step_bench.FLAGS([step_bench.__file__, f"--batch={args.batch}", f"--iters={args.repeats}"])
    peak, measured = args.peak, args.measured
    rows = []
    for spec in args.models:
        model, overrides, label = _variant(spec)
        for attn in args.attention_kernels:
            kw = {**({"attention_kernel": attn} if attn else {}), **overrides}
            trace = f"{args.trace}/{label}" if args.trace and not args.compile_only else None
            try:
                r = step_bench.bench(model, args.seq, compile_only=args.compile_only, trace_dir=trace, **kw)
            except Exception as e:  # noqa: BLE001
                rows.append({"model": model, **kw, "error": f"{type(e).__name__}: {str(e)[:400]}"})
                print(f"{spec}: ERROR {rows[-1]['error'][:200]}", flush=True)
                save(rows)
                continue
            if args.compile_only:
                rows.append(r)
                print(f"{spec} {attn}: compiled in {r['compile_s']:.0f} s", flush=True)
                continue
            r.pop("cpu_mfu"), r.pop("matmul_gflops"), r.pop("peak_rss_MiB")
            flops = r["model_gflops"] * 1e9
            r.update(label=label, batch=args.batch, trace_dir=trace,
                     mfu_vs_datasheet_peak=None if peak is None else flops / peak,
                     mfu_vs_measured_matmul=flops / measured)
            rows.append(r)
            save(rows)
            print(f"{spec} {attn}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s, "
                  f"{flops / 1e12:.1f} TFLOP/s, MFU {r['mfu_vs_datasheet_peak'] or 0:.1%} of peak, "
                  f"{r['mfu_vs_measured_matmul']:.1%} of the measured matmul", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("kernels", "step"))
    p.add_argument("--op", choices=("gla", "kda"), default="gla")
    p.add_argument("--ts", default="4096,16384,32768")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="kernels: fwd, fwd+bwd or both (comma-separated)")
    p.add_argument("--impls", default="", help="kernels: only these implementations (comma-separated; default all)")
    p.add_argument("--models", default="ling2-small,ling3-small",
                   help="step: model[:key=value...] variants, comma-separated (e.g. ling2-small:moe_gmm_backend=blocked)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--attention_kernels", default="cudnn,blocked",
                   help="step: MLA attention_kernel values ('' keeps the model file's)")
    p.add_argument("--trace", default="", help="step: write a JAX profiler trace of each row under this folder")
    p.add_argument("--compile_only", action="store_true",
                   help="step: compile only (fills JAX_COMPILATION_CACHE_DIR for a later timed process)")
    p.add_argument("--warm", action="store_true",
                   help="kernels: compile and run each once, untimed (fills the JAX cache and fla's autotuning cache)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.ts = [int(t) for t in args.ts.split(",")]
    args.models = args.models.split(",")
    args.modes = args.modes.split(",")
    args.impls = [i for i in args.impls.split(",") if i]
    args.attention_kernels = args.attention_kernels.split(",") if args.attention_kernels else [""]
    if jax.default_backend() != "gpu":
        raise SystemExit(f"tools/bench/gpu needs a GPU; JAX's default backend is {jax.default_backend()!r}")
    head = {**host_facts(), "command": " ".join(sys.argv[1:])}
    if args.what == "kernels":
        fla_name = {"gla": "fla_chunk_simple_gla", "kda": "fla_chunk_kda"}[args.op]
        head["shape"] = {"B": 2, "H": 16, "K": 128, "V": 128, "dtype": "bfloat16"}
        run = lambda save: kernels(args, save)
        post = lambda rows: with_ratios(rows, fla_name)
    else:
        kind = jax.devices()[0].device_kind
        peak = next((v for k, v in PEAK_BF16.items() if k in kind), None)
        head["datasheet_peak_bf16_tflops"] = None if peak is None else peak / 1e12
        head["measured_matmul_bf16_tflops"] = None if args.compile_only else matmul_rate() / 1e12
        args.peak, args.measured = peak, (head["measured_matmul_bf16_tflops"] or 0) * 1e12
        run = lambda save: step(args, save)
        post = lambda rows: rows

    def save(rows, done=False):
        with open(args.out, "w") as f:
            json.dump({**head, "complete": done, "rows": post(rows)}, f, indent=1)

    save(run(save), done=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
