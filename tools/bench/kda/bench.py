"""Benchmark of the KDA kernels: prints a table and writes JSON.

Default (CPU): the chunked form vs the naive per-token recurrence, B=1, H=4, K=V=128, fp32, gates as
the safe gate makes them, forward and forward+backward, at T = 1K, 4K, 16K. Memory is XLA's plan for
the compiled program (`memory_analysis()`): planned = arguments + outputs + temporaries, and the
temporaries alone, whose growth with T shows what the backward keeps (chunk states for chunked, a
K x V state per token for the naive scan's autodiff). A case planned above --mem_limit_gb is
compiled but not run. Ratios are other / first backend's time from the same run.

In the same run (first, so the table below is not its warm-up): the train step (forward + backward of
the training objective) of ling3-small beside ling2-small, tokens/s and their ratio (--step_models).

On a GPU, tools/bench/gpu times the Pallas GPU kernel against flash-linear-attention's Triton `chunk_kda`.

  bazel run //tools/bench/kda:bench -- [--ts 1024,4096,16384] [--backends chunked,naive] [--step_models ling2-small,ling3-small]
      [--out FILE]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from ling2.kernels import kda
from tools.bench.report import host_facts, median_seconds, planned_bytes, write_results


def _fn(backend, mode):
    fwd = lambda q, k, v, g, beta: kda.kda(q, k, v, g, beta, backend=backend)
    if mode == "fwd":
        return jax.jit(fwd)
    loss = lambda *a: jnp.sum(fwd(*a).astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def _inputs(B, T, H, D, dtype):
    """L2-normed q, k; v; the safe gate -5 sigmoid(.) in (-5, 0); beta = sigmoid(.)."""
    r = np.random.default_rng(0)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    sig = lambda x: 1 / (1 + np.exp(-x))
    q, k = (jnp.asarray(l2(r.standard_normal((B, T, H, D))), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, D)), dtype)
    g = jnp.asarray(-5 * sig(r.standard_normal((B, T, H, D)) - 3), jnp.float32)
    beta = jnp.asarray(sig(r.standard_normal((B, T, H))), jnp.float32)
    return q, k, v, g, beta


def run(args):
    rows = []
    for T in args.ts:
        ins = _inputs(args.batch, T, args.heads, args.dim, jnp.dtype(args.dtype))
        for mode in ("fwd", "fwd+bwd"):
            for backend in args.backends:
                compiled = _fn(backend, mode).lower(*ins).compile()
                mem = compiled.memory_analysis()
                row = {"T": T, "mode": mode, "impl": backend}
                if mem is not None:
                    row.update(planned_mb=planned_bytes(mem) / 2**20, temp_mb=mem.temp_size_in_bytes / 2**20)
                if mem is not None and planned_bytes(mem) > args.mem_limit_gb * 2**30:
                    row["skipped"] = f"planned {planned_bytes(mem) / 2**30:.1f} GB > --mem_limit_gb {args.mem_limit_gb}"
                else:
                    row["seconds"] = median_seconds(compiled, ins, args.repeats)
                rows.append(row)
                _print_row(row)
    base = {(r["T"], r["mode"]): r.get("seconds") for r in rows if r["impl"] == args.backends[0]}
    for r in rows:
        if r.get("seconds") and base.get((r["T"], r["mode"])):
            r[f"ratio_vs_{args.backends[0]}"] = r["seconds"] / base[(r["T"], r["mode"])]
    return rows


def memory_per_token(rows):
    """Temporary MB per 1K tokens for each (impl, mode): flat when memory is linear in T."""
    out = {}
    for r in rows:
        if "temp_mb" in r:
            out.setdefault(f"{r['impl']} {r['mode']}", {})[r["T"]] = 1024 * r["temp_mb"] / r["T"]
    for key, per_t in out.items():
        print(f"{key:>20}: " + ", ".join(f"T={T}: {mb:.1f}" for T, mb in per_t.items()) + " MB temp per 1K tokens")
    return out


def train_step_rows(args):
    """Train-step tokens/s of each of --step_models (default ling2-small, ling3-small) at --step_seq, in this
    run: tools/bench/step's `bench` times the jitted gradient of the training objective (main CE + MoE aux +
    MTP) on random tokens. Each row gets its ratio to the first model's tokens/s."""
    from tools.bench.step import bench as step_bench

    models = [m for m in args.step_models.split(",") if m]
    if not models:
        return []
    step_bench.FLAGS([step_bench.__file__, f"--batch={args.step_batch}", f"--iters={args.repeats}"])
    rows = []
    for m in models:
        r = step_bench.bench(m, args.step_seq)
        rows.append({k: r[k] for k in ("model", "seq", "dtype", "params_M", "step_s", "tokens_per_s", "cpu_mfu",
                                       "planned_MiB")})
    for r in rows:
        r[f"tokens_per_s_vs_{models[0]}"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"train step (forward + backward, B={args.step_batch}, S={args.step_seq}):")
    print(f"{'model':>12} {'dtype':>9} {'params':>8} {'step':>10} {'tok/s':>9} {'vs ' + models[0]:>16} {'MFU':>6}")
    for r in rows:
        print(f"{r['model']:>12} {r['dtype']:>9} {r['params_M']:7.1f}M {r['step_s']:9.3f}s {r['tokens_per_s']:9.0f} "
              f"{r[f'tokens_per_s_vs_{models[0]}']:15.2f}x {r['cpu_mfu']:6.1%}", flush=True)
    print()
    return rows


def _print_row(r):
    t = f"{r['seconds'] * 1e3:10.1f} ms" if r.get("seconds") else f"{'-':>13}"
    mem = f"{r['planned_mb']:9.1f} MB {r['temp_mb']:9.1f} MB" if "planned_mb" in r else f"{'':>26}"
    print(f"{r['T']:>6} {r['mode']:>8} {r['impl']:>10} {t} {mem}  {r.get('skipped', '')}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ts", default="1024,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--backends", default="chunked,naive", help=f"comma-separated, from {kda.BACKENDS}")
    p.add_argument("--dtype", default="float32", help="q, k, v dtype (float32 or bfloat16)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128, help="K = V head dim")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mem_limit_gb", type=float, default=4.0, help="skip cases planned above this")
    p.add_argument("--step_models", default="ling2-small,ling3-small",
                   help="models whose train step is timed in the same run ('' skips); ratios to the first")
    p.add_argument("--step_seq", type=int, default=1024, help="sequence length of the train-step rows")
    p.add_argument("--step_batch", type=int, default=1, help="rows per train step")
    p.add_argument("--out", default="", help="JSON path (default: tools/bench/kda/results_<platform>.json under "
                   "the workspace with bazel run, else in the current directory)")
    args = p.parse_args()
    args.ts = [int(t) for t in args.ts.split(",")]
    args.backends = args.backends.split(",")
    for b in args.backends:
        if b not in kda.BACKENDS:
            p.error(f"--backends: {b!r} is not one of {kda.BACKENDS}")
    if args.dtype not in ("float32", "bfloat16"):
        p.error(f"--dtype={args.dtype!r}: expected float32 or bfloat16")
    step_rows = train_step_rows(args)
    print(f"{'T':>6} {'mode':>8} {'impl':>10} {'time':>13} {'planned':>12} {'temp':>12}")
    rows = run(args)
    print(f"\nratio = impl time / {args.backends[0]} time (same run):")
    key = f"ratio_vs_{args.backends[0]}"
    for r in rows:
        if key in r and r["impl"] != args.backends[0]:
            print(f"{r['T']:>6} {r['mode']:>8} {r['impl']:>10} {r[key]:8.2f}x")
    print("\nmemory:")
    result = {**host_facts(),
              "shape": {"B": args.batch, "H": args.heads, "K": args.dim, "V": args.dim, "dtype": args.dtype},
              "rows": rows, "temp_mb_per_1k_tokens": memory_per_token(rows), "train_step": step_rows}
    print()
    write_results(result, args.out, "kda", f"results_{jax.default_backend()}.json")


if __name__ == "__main__":
    main()
