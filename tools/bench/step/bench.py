"""Decoder step benchmark: forward+backward tokens/s and "CPU MFU" for ling2-tiny and ling2-small.

    bazel run //tools/bench/step:bench -- --out=/tmp/step.json

Each row times the jitted gradient of the training objective (main CE + MoE aux + MTP) on
random tokens. In the same run a dense matmul of the model's compute dtype is timed, and the
model's FLOP/s (ling2.layers.model.training_flops_per_token) is reported as a fraction of
it. Peak memory is XLA's planned memory for the compiled step, plus the process peak RSS.
"""

import functools
import json
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from ling2.config.paths import user_path
from ling2.layers.spec import ModelSpec
from tools.bench.report import planned_bytes

flags.DEFINE_string("out", "step_bench.json", "JSON output (relative: the working directory).")
flags.DEFINE_list("models", ["ling2-tiny", "ling2-small"], "Models.")
flags.DEFINE_list("seqs", ["1024", "4096"], "Sequence lengths.")
flags.DEFINE_integer("batch", 1, "Rows per step.")
flags.DEFINE_integer("iters", 2, "Timed iterations per row (after one warm-up).")
FLAGS = flags.FLAGS


def _time(f, *args, iters):
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def matmul_flops(dtype, n: int = 2048, iters: int = 3) -> float:
    x = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), dtype)
    f = jax.jit(lambda a: a @ a)
    return 2 * n**3 / _time(f, x, iters=iters)


def bench(model_name: str, seq: int, compile_only: bool = False, trace_dir: str | None = None,
          trace_steps: int = 3, **overrides) -> dict:
    """One row; `overrides` are config keys (e.g. attention_kernel="cudnn"). compile_only: stop after the
    compile (which a persistent compilation cache keeps for a later process). trace_dir: after timing, a JAX
    profiler trace of `trace_steps` more steps is written there (tools/bench/gpu/trace reads it)."""
    from ling2.config import load_config
    from ling2.layers.model import Ling2Model, count_params, training_flops_per_token
    from ling2.train import step as S
    from ling2.train.state import trainable_filter

    max_pos = max(seq, load_config(model_name=model_name).max_position_embeddings)  # rope tables reach seq
    cfg = load_config(model_name=model_name, max_target_length=seq, max_position_embeddings=max_pos, scan_layers=True,
                      **overrides)
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    gd, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    r = np.random.default_rng(0)
    B = FLAGS.batch
    ids = r.integers(0, cfg.vocab_size, (B, seq + 1))
    mb = dict(inputs=jnp.asarray(ids[:, :-1]), targets=jnp.asarray(ids[:, 1:]),
              positions=jnp.broadcast_to(jnp.arange(seq), (B, seq)), segment_ids=jnp.ones((B, seq), jnp.int32),
              loss_weights=jnp.ones((B, seq), jnp.float32))
    norms = {"tokens": jnp.float32(B * seq), "mtp_tokens": jnp.full((cfg.mtp_num_layers,), B * seq, jnp.float32)}
    grad = jax.jit(jax.grad(functools.partial(S.forward, gd, cfg=cfg, step_tokens=norms), argnums=0, has_aux=True))
    t0 = time.perf_counter()
    compiled = grad.lower(params, rest, mb).compile()  # compiled once: timed below, memory read from it
    compile_s = time.perf_counter() - t0
    if compile_only:
        return {"model": model_name, "seq": seq, **overrides, "compile_s": compile_s}
    f = lambda p: compiled(p, rest, mb)
    mem = compiled.memory_analysis()
    dt = _time(f, params, iters=FLAGS.iters)
    if trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(trace_steps):
                out = f(params)
            jax.block_until_ready(out)
    ref = matmul_flops(jnp.dtype(cfg.dtype))
    tps = B * seq / dt
    model_flops = tps * training_flops_per_token(ModelSpec.of(cfg), seq)
    planned = planned_bytes(mem)
    return {"model": model_name, "seq": seq, **overrides, "dtype": cfg.dtype, "compile_s": compile_s,
            "params_M": count_params(ModelSpec.of(cfg))["total"] / 1e6, "step_s": dt, "tokens_per_s": tps, "model_gflops": model_flops / 1e9, "matmul_gflops": ref / 1e9,
            "cpu_mfu": model_flops / ref, "planned_MiB": planned / 2**20,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv):
    rows = [bench(m, int(s)) for m in FLAGS.models for s in FLAGS.seqs]
    cols = ["model", "seq", "dtype", "params_M", "step_s", "tokens_per_s", "model_gflops", "matmul_gflops", "cpu_mfu",
            "planned_MiB", "peak_rss_MiB"]
    print(" | ".join(f"{c:>13s}" for c in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:>13.4g}" if isinstance(r[c], float) else f"{str(r[c]):>13s}" for c in cols))
    small = [r["cpu_mfu"] for r in rows if r["model"] == "ling2-small"]
    targets = {"ling2-small cpu_mfu >= 0.30": bool(small) and min(small) >= 0.30}
    print("targets:", targets)
    out = user_path(FLAGS.out)
    with open(out, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows, "targets": targets}, fh, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
