"""FP8 on a real GPU (Hopper): GEMM time of a projection forward+backward in bf16 vs quantization=fp8, a
model train step bf16 vs fp8, and which GEMMs of the compiled fp8 step take float8 operands.

  python -m tools.bench.fp8.gpu --out results_gpu.json   (on the GPU machine, tools/bench/fp8/device_run.sh)

Rows are written after each measurement, so a run cut short keeps what it measured.
"""

import argparse
import collections
import functools
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ling2.kernels import fp8
from tools.bench.report import host_facts, time_round_robin


def projection_rows(shapes, repeats):
    """fwd+bwd of y = x w ([M, K] x [K, N]) for bf16, fp8 tensor and fp8 block; TFLOP/s on 3 GEMMs."""
    rows = []
    for M, K, N in shapes:
        r = np.random.default_rng(0)
        x = jnp.asarray(r.standard_normal((M, K)), jnp.bfloat16)
        w = jnp.asarray(r.standard_normal((K, N)) * K**-0.5, jnp.bfloat16)
        fns, names = [], []
        for name, q in (("bf16", None), ("fp8", fp8.Fp8("tensor")), ("fp8-block", fp8.Fp8("block"))):
            loss = lambda x, w, q=q: jnp.sum(fp8.einsum("mk,kn->mn", x, w, q).astype(jnp.float32))
            g = jax.jit(jax.grad(loss, argnums=(0, 1)))
            jax.block_until_ready(g(x, w))
            fns.append(functools.partial(g, x, w))
            names.append(name)
        times = time_round_robin(fns, repeats)
        for name, t in zip(names, times):
            rows.append({"what": "projection fwd+bwd", "M": M, "K": K, "N": N, "mode": name, "seconds": t,
                         "tflops": 3 * 2 * M * K * N / t / 1e12, "vs_bf16": times[0] / t})
            print(f"projection {M}x{K}x{N} {name:9s} {t * 1e3:8.3f} ms  {rows[-1]['tflops']:7.1f} TFLOP/s  "
                  f"x{rows[-1]['vs_bf16']:.2f} of bf16", flush=True)
    return rows


def step_rows(models, seq, batch, repeats):
    from tools.bench.step import bench as step_bench

    step_bench.FLAGS([step_bench.__file__, f"--batch={batch}", f"--iters={repeats}"])
    rows = []
    for model in models:
        for name, kw in (("bf16", {}), ("fp8", {"quantization": "fp8"})):
            try:
                r = step_bench.bench(model, seq, attention_kernel="cudnn", **kw)
                r.pop("cpu_mfu", None), r.pop("matmul_gflops", None), r.pop("peak_rss_MiB", None)
                rows.append({"what": "train step (grad)", "mode": name, "batch": batch, **r})
                print(f"{model} {name}: {r['step_s'] * 1e3:.1f} ms/step {r['tokens_per_s']:.0f} tokens/s "
                      f"{r['model_gflops'] / 1e3:.1f} TFLOP/s planned {r['planned_MiB']:.0f} MiB", flush=True)
            except Exception as e:  # noqa: BLE001 - a failure is a result
                rows.append({"what": "train step (grad)", "model": model, "mode": name,
                             "error": f"{type(e).__name__}: {str(e)[:400]}"})
                print(f"{model} {name}: ERROR {rows[-1]['error'][:200]}", flush=True)
    return rows


def hlo_rows(model):
    """The fp8 train step compiled for this GPU: its dots by operand types and the GEMM emitters used."""
    from ling2.config.loader import load_config
    from ling2.kernels.testing.cuda import dot_operand_types
    from ling2.train.loop import compile_train_step
    from ling2.train.runtime import make_mesh
    from ling2.train.state import abstract_state

    cfg = load_config(model_name=model, quantization="fp8", max_target_length=1024, per_device_batch_size=2)
    mesh = make_mesh(cfg, jax.devices()[:1])
    text = compile_train_step(cfg, mesh, abstract_state(cfg, mesh)).as_text()
    dots = collections.Counter(f"{a} x {b}" for a, b, _ in dot_operand_types(text))
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    kinds = collections.Counter(re.findall(r'"kind":"(__[a-z_]+)"', text))
    row = {"what": "compiled fp8 step", "model": model, "dots_by_operand_types": dict(dots),
           "custom_calls": dict(targets), "fusion_backend_kinds": dict(kinds)}
    print(json.dumps(row), flush=True)
    return [row]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="hlo,projection,step")
    ap.add_argument("--models", default="ling2-small")
    ap.add_argument("--hlo_model", default="ling2-tiny")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"tools/bench/fp8/gpu.py needs a GPU; JAX's default backend is {jax.default_backend()!r}")
    doc = {**host_facts(), "command": " ".join(sys.argv[1:]), "rows": []}

    def save():
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)

    for what in a.what.split(","):
        t0 = time.time()
        if what == "hlo":
            doc["rows"] += hlo_rows(a.hlo_model)
        elif what == "projection":
            doc["rows"] += projection_rows([(16384, 4096, 4096), (16384, 4096, 14336), (32768, 512, 2048)],
                                           a.repeats)
        elif what == "step":
            doc["rows"] += step_rows(a.models.split(","), a.seq, a.batch, a.repeats)
        doc.setdefault("phase_seconds", {})[what] = time.time() - t0
        save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
