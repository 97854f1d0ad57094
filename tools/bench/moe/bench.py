"""Benchmark of one MoE block (ling2-small: D=512, 64 experts top-8 of width 64, shared 256):
forward+backward tokens/s of the dropless sorted path and the dense capacity path, beside a
dense SwiGLU MLP doing the same useful FLOPs, all in one run. Prints a table and writes JSON.

Useful FLOPs per token (forward): router 2*D*E + routed 6*D*F*K + shared 6*D*Fs; the dense
reference is one SwiGLU of width K*F + Fs (+ the router's matmul) so it does the same work;
forward+backward counts 3x. "ratio" is a case's useful FLOP rate / the dense reference's.
Memory is XLA's planned peak of the compiled step (arguments + outputs + temporaries).
Timed cases alternate (round-robin, median of --repeats) so a shared machine's load is shared.
On CPU the dropless path uses the tiled grouped matmul; --ragged_dot also times
jax.lax.ragged_dot, which XLA:CPU expands to a dense masked product (E times the work).

  bazel run //tools/bench/moe:bench -- [--batch 4 --seq 512] [--dtype float32] [--repeats 3] [--out FILE]
  bazel run --config=tpu //tools/bench/moe:bench -- --tpu_compile [--out FILE]   # backends compiled for v5p
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config import load_config
from ling2.layers.moe.layer import MoE
from ling2.layers.moe.experts import Mlp
from ling2.config.specs import MoESpec, WeightsSpec
from tools.bench.report import host_facts, planned_bytes, time_round_robin, write_results


def _planned(compiled):
    m = compiled.memory_analysis()
    if m is None:
        return None
    return planned_bytes(m)


class DenseRef(nnx.Module):
    """Dense SwiGLU of the same useful width as the MoE (K*F + Fs) plus a router-sized matmul."""

    def __init__(self, cfg, *, rngs):
        self.mlp = Mlp(WeightsSpec.of(cfg), cfg.num_experts_per_tok * cfg.base_moe_mlp_dim + cfg.shared_experts * cfg.shared_expert_dim,
                       rngs=rngs)
        self.router = nnx.Param(jax.random.normal(rngs.params(), (cfg.base_emb_dim, cfg.num_experts)) * cfg.init_std)

    def __call__(self, x):
        logits = jnp.dot(x.astype(jnp.float32), self.router[...], precision=jax.lax.Precision.HIGHEST)
        return self.mlp(x) + 0 * logits.sum(-1, keepdims=True).astype(x.dtype), None


def make_step(module):
    def loss(m, x, ct):
        y, aux = m(x)
        extra = aux.loss if aux is not None else 0.0
        return jnp.sum(y.astype(jnp.float32) * ct) + extra

    return nnx.jit(nnx.grad(loss, argnums=(0, 1)))


def compile_case(module, x, ct):
    step = make_step(module)
    graphdef, state = nnx.split(module)
    compiled = jax.jit(lambda s, x, ct: step(nnx.merge(graphdef, s), x, ct)).lower(state, x, ct).compile()
    jax.block_until_ready(compiled(state, x, ct))  # warm-up
    return lambda: compiled(state, x, ct), _planned(compiled)


def tpu_compile(out: str):
    """The grouped SwiGLU alone, forward+backward, compiled for one v5p chip (the real XLA:TPU +
    Mosaic compiler on any host; tpu venv) per backend, at model_name=ling2's per-device
    expert-parallel shape (8 x 32,768 rows received, D 2048, F 512) with 32 local experts (expert
    axis 8) and with 8: XLA's FLOPs against the grouped count, temporaries, code, compile time."""
    from ling2 import topology
    from ling2.kernels.moe import gmm as moe_gmm
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(topology.devices("v5p-8")[:1]), ("d",))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    M, D, F = 8 * 32768, 2048, 512
    grouped = 3 * 2 * M * D * 3 * F
    rows = []
    for E in (32, 8):
        for gmm in ("megablox", "ragged_dot"):
            def loss(x, gs, wg, wu, wd):
                return jnp.sum(moe_gmm.grouped_ffn(x, gs, (wg, wu, wd), gmm).astype(jnp.float32) ** 2)
            args = (s((M, D), jnp.bfloat16), s((E,), jnp.int32), s((E, D, F), jnp.bfloat16),
                    s((E, D, F), jnp.bfloat16), s((E, F, D), jnp.bfloat16))
            t0 = time.perf_counter()
            c = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4))).lower(*args).compile()
            sec = time.perf_counter() - t0
            cost = c.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            mem = c.memory_analysis()
            rows.append({"gmm": gmm, "local_experts": E, "xla_flops": cost["flops"],
                         "xla_flops_vs_grouped": cost["flops"] / grouped, "temp_mib": mem.temp_size_in_bytes / 2**20,
                         "code_mib": mem.generated_code_size_in_bytes / 2**20, "compile_s": sec,
                         "mosaic_calls": c.as_text().count('custom_call_target="tpu_custom_call"')})
    print(f"grouped SwiGLU fwd+bwd compiled for v5p, M={M} D={D} F={F} bf16; grouped count {grouped:.3g} FLOPs")
    print(f"{'gmm':<12}{'experts':>8}{'XLA FLOPs':>12}{'vs grouped':>11}{'temp MiB':>10}{'code MiB':>10}"
          f"{'compile s':>10}{'Mosaic':>8}")
    for r in rows:
        print(f"{r['gmm']:<12}{r['local_experts']:>8}{r['xla_flops']:>12.3g}{r['xla_flops_vs_grouped']:>11.2f}"
              f"{r['temp_mib']:>10.0f}{r['code_mib']:>10.2f}{r['compile_s']:>10.1f}{r['mosaic_calls']:>8}")
    result = {"bench": "moe_tpu_compile", **host_facts(), "target": "v5p (compile-only)",
              "shape": {"M": M, "D": D, "F": F}, "grouped_flops": grouped, "rows": rows}
    write_results(result, out, "moe", "results_tpu_compile.json")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dtype", default="", help="compute dtype (default: float32 on CPU, the model's elsewhere)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--capacity_factor", type=float, default=1.25, help="of the dense capacity path")
    p.add_argument("--ragged_dot", action="store_true", help="also time jax.lax.ragged_dot (slow on CPU)")
    p.add_argument("--out", default="",
                   help="JSON path (default: tools/bench/moe/results_<platform>.json under bazel run, else cwd)")
    p.add_argument("--tpu_compile", action="store_true",
                   help="compile the grouped matmul backends for a v5p chip instead (tpu venv: --config=tpu)")
    a = p.parse_args()
    if a.tpu_compile:
        return tpu_compile(a.out)

    on_cpu = jax.default_backend() == "cpu"
    over = {"dtype": a.dtype} if a.dtype else ({"dtype": "float32"} if on_cpu else {})
    cfg = load_config(model_name="ling2-small", **over)
    D, E, K, F = cfg.base_emb_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.base_moe_mlp_dim
    Fs = cfg.shared_experts * cfg.shared_expert_dim
    T = a.batch * a.seq
    flops = 3 * T * (2 * D * E + 6 * D * F * K + 6 * D * Fs)
    dt = jnp.dtype(cfg.dtype)
    x = jax.random.normal(jax.random.key(0), (a.batch, a.seq, D)).astype(dt)
    ct = jax.random.normal(jax.random.key(1), (a.batch, a.seq, D))

    cases = [("dense_matmul", lambda: DenseRef(cfg, rngs=nnx.Rngs(0))),
             ("moe_dropless", lambda: MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))),
             ("moe_dense_capacity", lambda: MoE(MoESpec.of(cfg.model_copy(update=dict(
                 sparse_matmul=False, capacity_factor=a.capacity_factor))), rngs=nnx.Rngs(0)))]
    if a.ragged_dot or not on_cpu:
        cases.append(("moe_ragged_dot", lambda: MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0), gmm="ragged_dot")))
    compiled = [compile_case(build(), x, ct) for _, build in cases]
    secs = time_round_robin([fn for fn, _ in compiled], a.repeats)
    rows = []
    for (name, _), (_, mem), sec in zip(cases, compiled, secs):
        rows.append({"case": name, "ms": sec * 1e3, "tokens_per_s": T / sec, "gflops": flops / sec / 1e9,
                     "planned_mb": None if mem is None else mem / 2 ** 20})
    ref = rows[0]["gflops"]
    for r in rows:
        r["ratio_vs_dense_matmul"] = r["gflops"] / ref

    print(f"MoE block fwd+bwd, ling2-small D={D} E={E} K={K} F={F} shared={Fs}, B={a.batch} S={a.seq} "
          f"dtype={cfg.dtype} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    print(f"useful work {flops / 1e9:.2f} GFLOP per step; target: moe_dropless ratio >= 0.50")
    print(f"{'case':<22}{'ms/step':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'ratio':>8}{'planned MB':>12}")
    for r in rows:
        mb = "-" if r["planned_mb"] is None else f"{r['planned_mb']:.0f}"
        print(f"{r['case']:<22}{r['ms']:>10.1f}{r['tokens_per_s']:>12.0f}{r['gflops']:>10.1f}"
              f"{r['ratio_vs_dense_matmul']:>8.2f}{mb:>12}")

    result = {"bench": "moe", **host_facts(),
              "config": {"model": "ling2-small", "D": D, "E": E, "K": K, "F": F, "shared": Fs, "batch": a.batch,
                         "seq": a.seq, "dtype": cfg.dtype, "capacity_factor": a.capacity_factor},
              "useful_gflop_per_step": flops / 1e9, "rows": rows}
    write_results(result, a.out, "moe", f"results_{jax.default_backend()}.json")


if __name__ == "__main__":
    main()
