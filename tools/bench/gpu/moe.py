"""The MoE grouped SwiGLU alone on one NVIDIA GPU, forward and forward+backward, per grouped-matmul backend.

    python -m tools.bench.gpu.moe --out moe.json [--widths 512x64,2048x512] [--backends ...]

Rows are T tokens x top-K sorted by expert (a uniform random routing: near-balanced groups), D model dim,
F expert width, E local experts, bf16. Backends: Ling2's `moe_gmm.grouped_ffn` ones (pallas_gpu, blocked,
ragged_dot; with `_fp8`, e.g. pallas_gpu_fp8: the same backend's FP8 GEMMs, per-tensor scaling) and `mosaic_gpu`, JAX's Pallas Mosaic GPU ragged dot (jax.experimental.pallas.ops.gpu:
ragged_dot_mgpu forward and dx, transposed_ragged_dot_mgpu for dw; Hopper wgmma), wired here as a SwiGLU
with its own VJP only to compare. Times are device-bound: `--calls` calls queued back to back, then one
synchronisation, per call (median of 3 such batches). The GEMM FLOPs are 6 M D F forward, 3x that with the
backward; the ratio to a bf16 8192^3 matmul timed in the same run says how close each is to the card's rate.
A backend whose compiled program plans more than 4 GiB and 8x its operands' bytes of temporaries (XLA:GPU
lowering ragged_dot dense over the experts) is recorded and not run.
"""

import argparse
import json
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ling2.kernels import fp8
from ling2.kernels.moe import gmm as moe_gmm
from tools.bench.report import host_facts, matmul_rate, timed_rates


def _mgpu_ffn():
    """SwiGLU over sorted rows by JAX's Mosaic GPU ragged dots, with a VJP of the same kernels."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rd
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd

    cfg = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)

    @jax.custom_vjp
    def mm(x, w, gs):
        return rd.ragged_dot(x, w, group_sizes=gs, **cfg)

    def fwd(x, w, gs):
        return mm(x, w, gs), (x, w, gs)

    def bwd(res, dy):
        x, w, gs = res
        dx = rd.ragged_dot(dy, w, group_sizes=gs, transpose_rhs=True, **cfg)
        dw = trd.transposed_ragged_dot(x, dy, group_sizes=gs, **cfg)
        return dx, dw.astype(w.dtype), None

    mm.defvjp(fwd, bwd)

    def ffn(x, gs, wg, wu, wd):
        F = wd.shape[1]
        g, u = jnp.split(mm(x, jnp.concatenate([wg, wu], -1), gs), [F], -1)
        return mm(jax.nn.silu(g) * u, wd, gs)

    return ffn


def _fn(backend):
    if backend == "mosaic_gpu":
        return _mgpu_ffn()
    if ":" in backend:  # pallas_gpu:variant, with the kernels' tiles set while it traces
        return _with_tiles(backend.split(":", 1)[1], lambda x, gs, *w: moe_gmm.grouped_ffn(x, gs, w, "pallas_gpu"))
    q = fp8.Fp8("tensor") if backend.endswith("_fp8") else None
    return lambda x, gs, wg, wu, wd: moe_gmm.grouped_ffn(x, gs, (wg, wu, wd), backend.removesuffix("_fp8"), q=q)


def _with_tiles(variant: str, f):
    """f with ling2.kernels.moe.pallas_gpu's tiles, warps and stages set from `variant` while it traces:
    "tm.tp.tq.warps.stages/tm.tq.tp.warps.stages" (gmm / tgmm)."""
    from ling2.kernels.moe import pallas_gpu as k

    (g, t) = ([int(v) for v in part.split(".")] for part in variant.split("/"))

    def wrapped(*a):
        old = k.GMM_TILES, k.TGMM_TILES, k.GMM_WARPS, k.GMM_STAGES, k.TGMM_WARPS, k.TGMM_STAGES
        k.GMM_TILES, k.GMM_WARPS, k.GMM_STAGES = tuple(g[:3]), g[3], g[4]
        k.TGMM_TILES, k.TGMM_WARPS, k.TGMM_STAGES = tuple(t[:3]), t[3], t[4]
        try:
            return f(*a)
        finally:
            k.GMM_TILES, k.TGMM_TILES, k.GMM_WARPS, k.GMM_STAGES, k.TGMM_WARPS, k.TGMM_STAGES = old

    return wrapped


def rows(args, rate, save):
    out = []
    E, K, T = args.experts, args.topk, args.tokens
    M = T * K
    for D, F in args.widths:
        r = np.random.default_rng(0)
        experts = np.argsort(r.random((T, E)), axis=1)[:, :K]
        gs = jnp.asarray(np.bincount(experts.ravel(), minlength=E), jnp.int32)
        x = jnp.asarray(r.standard_normal((M, D)) * 0.5, jnp.bfloat16)
        w = [jnp.asarray(r.standard_normal(s) * s[-2] ** -0.5, jnp.bfloat16) for s in ((E, D, F), (E, D, F), (E, F, D))]
        operand_bytes = 2 * (2 * M * D + 3 * E * D * F)
        for backend in args.backends:
            f = _fn(backend)
            for mode in ("fwd", "fwd+bwd"):
                row = {"D": D, "F": F, "E": E, "K": K, "M": M, "backend": backend, "mode": mode,
                       "gemm_flops": 6 * M * D * F * (1 if mode == "fwd" else 3)}
                try:
                    if mode == "fwd":
                        g = f
                    else:
                        g = lambda x, gs, *w: jax.grad(lambda x, *w: jnp.sum(f(x, gs, *w).astype(jnp.float32)),
                                                       argnums=(0, 1, 2, 3))(x, *w)
                    t0 = time.perf_counter()
                    c = jax.jit(g).lower(x, gs, *w).compile()
                    row["compile_s"] = time.perf_counter() - t0
                    row["temp_GiB"] = c.memory_analysis().temp_size_in_bytes / 2**30
                    if row["temp_GiB"] > 4 and row["temp_GiB"] * 2**30 > 8 * operand_bytes:
                        row["skipped"] = "plans > 8x its operands' bytes of temporaries (dense over the experts)"
                    else:
                        row.update(timed_rates(c, (x, gs, *w), row["gemm_flops"], rate, args.calls))
                except Exception as e:  # noqa: BLE001 - a backend that fails is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out.append(row)
                save(out)
                print(f"D={D:5d} F={F:4d} {backend:>11} {mode:>8}: " + (
                    f"ERROR {row['error'][:150]}" if "error" in row else row.get("skipped") or
                    f"{row['seconds'] * 1e3:8.2f} ms  {row['tflops']:6.1f} TFLOP/s  {row['of_matmul_rate']:.2f} of matmul"
                    f"  temp {row['temp_GiB']:.2f} GiB"), flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="512x64,2048x512", help="DxF pairs: ling2-small's and ling2's")
    p.add_argument("--backends", default="pallas_gpu,pallas_gpu_fp8,blocked,blocked_fp8,mosaic_gpu,ragged_dot",
                   help="also pallas_gpu:TM.TP.TQ.WARPS.STAGES/TM.TQ.TP.WARPS.STAGES (the gmm / tgmm kernels' tiles)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8 * 4096)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.widths = [tuple(int(v) for v in s.split("x")) for s in args.widths.split(",")]
    args.backends = args.backends.split(",")
    if jax.default_backend() != "gpu":
        raise SystemExit(f"tools/bench/gpu/moe needs a GPU; JAX's default backend is {jax.default_backend()!r}")
    rate = matmul_rate(calls=args.calls)
    head = {**host_facts(), "command": " ".join(sys.argv[1:]), "matmul_bf16_tflops": rate / 1e12}
    print(f"bf16 8192^3 matmul: {rate / 1e12:.0f} TFLOP/s", flush=True)

    def save(rs, done=False):
        with open(args.out, "w") as f:
            json.dump({**head, "complete": done, "rows": rs}, f, indent=1)

    save(rows(args, rate, save), done=True)


if __name__ == "__main__":
    main()
