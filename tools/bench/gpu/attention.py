"""MLA's softmax attention alone on one NVIDIA GPU, forward and forward+backward: where cuDNN's time goes.

    python -m tools.bench.gpu.attention --out attention.json [--models ling2-1gpu,ling3-1gpu] [--batch 4]

In run 2's traces cuDNN's fused attention ran at 140-175 TFLOP/s on an H200 (ling3-1gpu: 4.7 ms forward and
14.8 ms backward per MLA layer), far below the card's rate. Two things Ling2 asks of it may cost that:
packed documents enter as a dense [B, 1, T, S] mask, which JAX hands cuDNN as a bias, and MLA's head dims
(q and k 192, v 128) are not the 128 cuDNN is tuned for: v is padded to 192. Variants, each at the model's
MLA shape (B rows of --seq tokens, its heads, bf16; documents of random lengths, about --doc tokens each):
  ling2          `cudnn_attention` as the model calls it (segment mask, causal, v padded to the q head dim);
  ling2_blocked  `blocked_attention`, the XLA path Ling2 takes where cuDNN does not apply;
  causal         cuDNN, causal only, no mask (the documents' boundaries ignored: what the mask costs);
  causal_qk128   the same with q, k and v 128 wide (cuDNN's best-tuned shape: the rate to expect);
Times are device-bound (`queued_seconds`). FLOPs count the causal half with the real head dims (q.k 192, p.v
128: 2 B H T^2 (Dqk + Dv) / 2 forward, 2.5x that with the backward).
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ling2.config import load_config
from ling2.kernels.attention.cudnn import cudnn_attention
from ling2.kernels.attention.dense import blocked_attention
from tools.bench.report import host_facts, matmul_rate, queued_seconds

VARIANTS = ("ling2", "ling2_blocked", "causal", "causal_qk128")


def segments(B, T, doc, seed=0):
    """[B, T] int32 document ids of random lengths (exponential, mean `doc`): a packed batch."""
    r = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        ends = np.cumsum(np.maximum(1, r.exponential(doc, T // 16 + 1)).astype(int))
        out[b] = np.searchsorted(ends[ends < T], np.arange(T), side="right")
    return jnp.asarray(out)


def fn(variant, scale, block):
    """(q, k, v, seg) -> attention output, for `variant` (see the module doc)."""
    if variant == "ling2":
        return lambda q, k, v, seg: cudnn_attention(q, k, v, seg, scale, block)
    if variant == "ling2_blocked":
        return lambda q, k, v, seg: blocked_attention(q, k, v, seg, scale, block)

    def causal(q, k, v, seg):
        K = q.shape[-1]
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, K - v.shape[-1])))
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")

    return causal


def rows(args, rate, save):
    out = []
    for model in args.models:
        cfg = load_config(model_name=model)
        B, T, H = args.batch, args.seq, cfg.base_num_query_heads
        Dqk, Dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        r = np.random.default_rng(0)
        seg = segments(B, T, args.doc)
        for variant in args.variants:
            dqk, dv = (128, 128) if variant == "causal_qk128" else (Dqk, Dv)
            q, k = (jnp.asarray(r.standard_normal((B, T, H, dqk)), jnp.bfloat16) for _ in range(2))
            v = jnp.asarray(r.standard_normal((B, T, H, dv)), jnp.bfloat16)
            f = fn(variant, dqk ** -0.5, args.block)
            fwd_flops = 2 * B * H * T * T * (dqk + dv) // 2
            for mode in ("fwd", "fwd+bwd"):
                row = {"model": model, "variant": variant, "mode": mode, "B": B, "T": T, "H": H, "Dqk": dqk, "Dv": dv,
                       "flops": fwd_flops if mode == "fwd" else int(3.5 * fwd_flops)}
                g = f if mode == "fwd" else jax.grad(
                    lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32)), argnums=(0, 1, 2))
                try:
                    c = jax.jit(g).lower(q, k, v, seg).compile()
                    row["seconds"] = queued_seconds(c, (q, k, v, seg), args.calls)
                    row["tflops"] = row["flops"] / row["seconds"] / 1e12
                    row["of_matmul_rate"] = row["flops"] / row["seconds"] / rate
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out.append(row)
                save(out)
                print(f"{model} {variant:>14} {mode:>8}: " + (f"ERROR {row['error'][:150]}" if "error" in row else
                      f"{row['seconds'] * 1e3:8.2f} ms  {row['tflops']:6.1f} TFLOP/s  "
                      f"{row['of_matmul_rate']:.2f} of matmul"), flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="ling2-1gpu,ling3-1gpu", help="model configs whose MLA shape to time")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--doc", type=int, default=1024, help="mean document length of the packed rows")
    p.add_argument("--block", type=int, default=512, help="ling2_blocked's query block")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.models, args.variants = args.models.split(","), args.variants.split(",")
    if jax.default_backend() != "gpu":
        raise SystemExit(f"tools/bench/gpu/attention needs a GPU; JAX's default backend is {jax.default_backend()!r}")
    rate = matmul_rate(calls=args.calls)
    head = {**host_facts(), "command": " ".join(sys.argv[1:]), "matmul_bf16_tflops": rate / 1e12}

    def save(rs, done=False):
        with open(args.out, "w") as f:
            json.dump({**head, "complete": done, "rows": rs}, f, indent=1)

    save(rows(args, rate, save), done=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
