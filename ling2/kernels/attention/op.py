"""Causal softmax attention with packed documents, the MLA layer's backends as one op:

  attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, backend=...) -> o [B, T, H, V] in q's dtype

Key s is visible to query t when s <= t and both lie in the same document (equal segment ids).
Backends (`BACKENDS`, cfg.attention_kernel): "dot_product" (plain einsums over the [T, S] logits, the
reference), "blocked" (the same einsums per query block over only the keys up to the block's end: the causal
half of the work and of the [T, S] buffers), "cudnn" (cuDNN's fused flash attention when lowered for CUDA and
the head dims fit, else "blocked": `cudnn`), "flash" (Pallas splash attention when lowered for TPU, interpret
mode elsewhere: `splash`). With an explicit mask (decoding against a cache) every backend takes the plain
einsums (`dense`).
"""

import jax.numpy as jnp

from ling2.kernels.attention import cudnn, splash
from ling2.kernels.attention.dense import attention_mask, blocked_attention, dot_product_attention

BACKENDS = ("dot_product", "blocked", "cudnn", "flash")


def attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, *, backend: str, block: int, mask_BTS=None):
    """o [B, T, H, V] by `backend`; `mask_BTS` None: causal + same segment among the T tokens themselves
    (T == S), else that mask over the S keys."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_kernel: unknown {backend!r} (expected one of {', '.join(BACKENDS)})")
    if mask_BTS is None:
        if backend == "flash":
            return splash.splash_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale)
        if backend == "cudnn":
            return cudnn.cudnn_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, block)
        if backend == "blocked":
            return blocked_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, block)
        index = jnp.broadcast_to(jnp.arange(q_BTHK.shape[1], dtype=jnp.int32), segment_BT.shape)
        mask_BTS = attention_mask(segment_BT, segment_BT, index, index)
    return dot_product_attention(q_BTHK, k_BSHK, v_BSHV, mask_BTS, scale)
