"""Benchmark of the simple-GLA kernels: prints a table and writes JSON.

CPU (default): chunked vs the naive per-token recurrence vs quadratic (T x T) attention,
B=1, H=4, D=128, fp32, forward and forward+backward, at T = 1K, 4K, 16K. The quadratic form
runs one head at a time (lax.map) to keep its T x T buffers to one head. Memory is XLA's
planned peak for the compiled program (arguments + outputs + temporaries), read from
`memory_analysis()`; a case whose plan exceeds --mem_limit_gb is compiled but not run.
Ratios are other / chunked time from the same run.

On a GPU, tools/bench/gpu times the Pallas GPU kernel against flash-linear-attention's Triton
op and cuDNN attention.

  bazel run //tools/bench/gla:bench -- [--ts 1024,4096,16384] [--repeats 3] [--out FILE]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from ling2.kernels import gla
from tools.bench.report import host_facts, median_seconds, planned_bytes, write_results


def _planned_bytes(compiled):
    m = compiled.memory_analysis()
    if m is None:
        return None
    return planned_bytes(m)


def _gla_fn(backend, mode, per_head=False, **kw):
    def fwd(q, k, v, g):
        if per_head:  # one head at a time: [B,T,H,D] -> map over H
            one = lambda qkvg: gla.simple_gla(qkvg[0][:, :, None], qkvg[1][:, :, None], qkvg[2][:, :, None],
                                              qkvg[3][None], backend=backend, **kw)[:, :, 0]
            o = jax.lax.map(one, (jnp.moveaxis(q, 2, 0), jnp.moveaxis(k, 2, 0), jnp.moveaxis(v, 2, 0), g))
            return jnp.moveaxis(o, 0, 2)
        return gla.simple_gla(q, k, v, g, backend=backend, **kw)

    if mode == "fwd":
        return jax.jit(fwd)
    loss = lambda q, k, v, g: jnp.sum(fwd(q, k, v, g).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _inputs(B, T, H, D, dtype):
    r = np.random.default_rng(0)
    q, k, v = (jnp.asarray(r.standard_normal((B, T, H, D)) * 0.1, dtype) for _ in range(3))
    g = -jnp.asarray(2.0 ** (-0.5 * (np.arange(H) + 1)), jnp.float32)
    return q, k, v, g


def run_cpu(args):
    impls = {"chunked": dict(backend="chunked"), "naive": dict(backend="naive"),
             "quadratic": dict(backend="quadratic", per_head=True)}
    rows = []
    for T in args.ts:
        ins = _inputs(1, T, 4, 128, jnp.float32)
        for mode in ("fwd", "fwd+bwd"):
            for name, kw in impls.items():
                fn = _gla_fn(mode=mode, **kw)
                compiled = fn.lower(*ins).compile()
                mem = _planned_bytes(compiled)
                row = {"T": T, "mode": mode, "impl": name, "planned_mb": None if mem is None else mem / 2**20}
                if mem is not None and mem > args.mem_limit_gb * 2**30:
                    row["skipped"] = f"planned {mem / 2**30:.1f} GB > --mem_limit_gb {args.mem_limit_gb}"
                elif f"{name}_{mode}" in args.skip.get(T, ()):
                    row["skipped"] = "not in the default run (use --full)"
                else:
                    row["seconds"] = median_seconds(compiled, ins, args.repeats)
                rows.append(row)
                _print_row(row)
    base = {(r["T"], r["mode"]): r.get("seconds") for r in rows if r["impl"] == "chunked"}
    for r in rows:
        if r.get("seconds") and base.get((r["T"], r["mode"])):
            r["ratio_vs_chunked"] = r["seconds"] / base[(r["T"], r["mode"])]
    return rows


def forward_bound(rows, H=4, K=128, V=128, C=64, speedup=5.0, n=2048):
    """How fast the chunked forward would have to run to be `speedup` x the naive scan.

    Both forwards need the 4 K V flops per token and head of q S_t and the k^T v state update;
    the chunked one adds its intra-chunk scores and their product with v (2 C (K + V)). The
    naive scan's own FLOP/s and the FLOP/s a chunked forward would need are given as fractions
    of a dense n x n fp32 matmul timed here (the CPU's practical peak for any matmul form).
    """
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    mm = jax.jit(lambda a: a @ a).lower(x).compile()
    peak = 2 * n**3 / median_seconds(mm, (x,), 5)
    out = []
    for r in rows:
        if r["impl"] != "naive" or r["mode"] != "fwd" or not r.get("seconds"):
            continue
        core, chunked = 4 * K * V * r["T"] * H, (4 * K * V + 2 * C * (K + V)) * r["T"] * H
        out.append({"T": r["T"], "matmul_gflops": peak / 1e9, "naive_gflops": core / r["seconds"] / 1e9,
                    "naive_fraction_of_matmul": core / r["seconds"] / peak,
                    f"needed_fraction_of_matmul_for_{speedup:g}x": speedup * chunked / r["seconds"] / peak,
                    f"needed_fraction_of_matmul_for_{speedup:g}x_without_intra_flops": speedup * core / r["seconds"] / peak})
        b = out[-1]
        print(f"T={b['T']}: dense matmul {b['matmul_gflops']:.0f} GFLOP/s; the naive forward runs at "
              f"{b['naive_gflops']:.0f} GFLOP/s ({b['naive_fraction_of_matmul']:.2f} of it); a chunked forward "
              f"{speedup:g}x faster needs {b[f'needed_fraction_of_matmul_for_{speedup:g}x']:.2f} of it "
              f"({b[f'needed_fraction_of_matmul_for_{speedup:g}x_without_intra_flops']:.2f} with no intra-chunk flops)")
    return out


def _print_row(r):
    t = f"{r['seconds'] * 1e3:10.1f} ms" if r.get("seconds") else f"{'-':>13}"
    mem = f"{r['planned_mb']:10.1f} MB" if r.get("planned_mb") is not None else f"{'':>13}"
    print(f"{str(r.get('T', '')):>6} {r.get('mode', ''):>8} {r['impl']:>22} {t} {mem}  {r.get('skipped', '')}",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ts", default="1024,4096,16384", help="comma-separated sequence lengths (CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mem_limit_gb", type=float, default=4.0, help="skip CPU cases planned above this")
    p.add_argument("--full", action="store_true", help="also run the slow CPU cases (quadratic/naive fwd+bwd at 16K)")
    p.add_argument("--out", default="", help="JSON path (default: tools/bench/gla/results_<platform>.json under "
                   "the workspace with bazel run, else in the current directory)")
    args = p.parse_args()
    args.ts = [int(t) for t in args.ts.split(",")]
    args.skip = {} if args.full else {16384: ("quadratic_fwd+bwd", "naive_fwd+bwd")}
    print(f"{'T':>6} {'mode':>8} {'impl':>22} {'time':>13} {'planned':>13}")
    rows = run_cpu(args)
    ratios = [(r["T"], r["mode"], r["impl"], r["ratio_vs_chunked"]) for r in rows
              if "ratio_vs_chunked" in r and r["impl"] != "chunked"]
    print("\nratio = impl time / chunked time (same run):")
    for T, mode, impl, ratio in ratios:
        print(f"{T:>6} {mode:>8} {impl:>22} {ratio:8.2f}x")
    result = {**host_facts(), "rows": rows}
    print("\nforward bound (chunked >= 5x naive needs this fraction of the dense matmul rate):")
    result["forward_bound"] = forward_bound(rows)
    print()
    write_results(result, args.out, "gla", f"results_{jax.default_backend()}.json")


if __name__ == "__main__":
    main()
