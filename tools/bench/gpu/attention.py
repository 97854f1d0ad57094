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
  mla_v128       JAX's own cuDNN binding (jax._src.cudnn, private) with v left 128 wide (cuDNN >= 9.10 on
                 Hopper takes q and v heads of different widths), the documents as the same bias;
  packed         the same binding with the documents as cuDNN's packed segments (per-row lengths and offsets,
                 no bias), v 128 wide;
Times are device-bound (`queued_seconds`). FLOPs count the causal half with the real head dims (q.k 192, p.v
128: 2 B H T^2 (Dqk + Dv) / 2 forward, 2.5x that with the backward). Each forward that respects the documents
is also compared with `ling2`'s output (`max_abs_diff_vs_ling2`), so a faster variant is known to be right.
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
from tools.bench.report import host_facts, matmul_rate, timed_rates

VARIANTS = ("ling2", "ling2_blocked", "causal", "causal_qk128", "mla_v128", "packed")
SAME_DOCUMENTS = ("ling2_blocked", "mla_v128", "packed")  # variants whose output must equal ling2's


def segments(B, T, doc, seed=0):
    """[B, T] int32 document ids of random lengths (exponential, mean `doc`): a packed batch."""
    r = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        ends = np.cumsum(np.maximum(1, r.exponential(doc, T // 16 + 1)).astype(int))
        out[b] = np.searchsorted(ends[ends < T], np.arange(T), side="right")
    return jnp.asarray(out)


def packed_segments(seg):
    """(lengths [B, M], offsets [B, M + 1]) of each row's documents for cuDNN's packed layout, -1 past a row's
    last (M: the most documents in a row), from the [B, T] ids of `segments` (host numpy)."""
    seg = np.asarray(seg)
    B, T = seg.shape
    starts = [np.flatnonzero(np.diff(row, prepend=-1)) for row in seg]
    M = max(len(s) for s in starts)
    lengths, offsets = -np.ones((B, M), np.int32), -np.ones((B, M + 1), np.int32)
    for b, s in enumerate(starts):
        lengths[b, :len(s)] = np.diff(np.append(s, T))
        offsets[b, :len(s) + 1] = np.append(s, T)
    return jnp.asarray(lengths), jnp.asarray(offsets)


def fn(variant, scale, block, seg=None):
    """(q, k, v, seg) -> attention output, for `variant` (see the module doc); `seg` the [B, T] document ids
    (host values: `packed` builds its segment table from them)."""
    if variant == "ling2":
        return lambda q, k, v, seg: cudnn_attention(q, k, v, seg, scale, block)
    if variant == "ling2_blocked":
        return lambda q, k, v, seg: blocked_attention(q, k, v, seg, scale, block)
    if variant in ("mla_v128", "packed"):
        from jax._src.cudnn import fused_attention_stablehlo as fa  # private: q and v heads of different widths

        if variant == "mla_v128":
            def mla(q, k, v, seg):
                bias = jnp.where(seg[:, :, None] == seg[:, None, :], 0.0, -1e9)[:, None].astype(q.dtype)
                return fa.dot_product_attention(q, k, v, bias, scale=scale, mask_type=fa.MaskType.CAUSAL)

            return mla
        lengths, offsets = packed_segments(seg)

        def packed(q, k, v, seg):
            return fa.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                            kv_offsets=offsets, scale=scale, mask_type=fa.MaskType.PADDING_CAUSAL)

        return packed

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
        qkv = {}
        for dqk, dv in {(Dqk, Dv), (128, 128)}:
            qkv[dqk, dv] = (*(jnp.asarray(r.standard_normal((B, T, H, dqk)), jnp.bfloat16) for _ in range(2)),
                            jnp.asarray(r.standard_normal((B, T, H, dv)), jnp.bfloat16))
        reference = None
        for variant in args.variants:
            dqk, dv = (128, 128) if variant == "causal_qk128" else (Dqk, Dv)
            q, k, v = qkv[dqk, dv]
            fwd_flops = 2 * B * H * T * T * (dqk + dv) // 2
            for mode in ("fwd", "fwd+bwd"):
                row = {"model": model, "variant": variant, "mode": mode, "B": B, "T": T, "H": H, "Dqk": dqk, "Dv": dv,
                       "flops": fwd_flops if mode == "fwd" else int(3.5 * fwd_flops)}
                try:
                    f = fn(variant, dqk ** -0.5, args.block, seg)
                    g = f if mode == "fwd" else jax.grad(
                        lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32)), argnums=(0, 1, 2))
                    c = jax.jit(g).lower(q, k, v, seg).compile()
                    if mode == "fwd" and variant == "ling2":
                        reference = c(q, k, v, seg).astype(jnp.float32)
                    elif mode == "fwd" and variant in SAME_DOCUMENTS and reference is not None:
                        row["max_abs_diff_vs_ling2"] = float(jnp.max(jnp.abs(c(q, k, v, seg) - reference)))
                    row.update(timed_rates(c, (q, k, v, seg), row["flops"], rate, args.calls))
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out.append(row)
                save(out)
                print(f"{model} {variant:>14} {mode:>8}: " + (f"ERROR {row['error'][:150]}" if "error" in row else
                      f"{row['seconds'] * 1e3:8.2f} ms  {row['tflops']:6.1f} TFLOP/s  "
                      f"{row['of_matmul_rate']:.2f} of matmul"
                      + (f"  max |diff| vs ling2 {row['max_abs_diff_vs_ling2']:.3g}"
                         if "max_abs_diff_vs_ling2" in row else "")), flush=True)
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
