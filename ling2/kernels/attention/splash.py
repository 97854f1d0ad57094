"""Pallas splash attention (TPU) for the causal, packed-document case: one call per batch row
(`splash_attention`), and the causal mask with a fast block summary that splash's host-side tables need
(`causal_mask`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.cache
def causal_mask(T: int):
    """splash's causal mask of [T, T] with a fast block summary: splash builds its block tables on the host by
    asking the mask for every [q block, kv block] (T^2 values in all, hours at 1M tokens); blocks wholly
    below or above the diagonal answer with one value here, only the blocks it crosses are computed. The
    kernel itself computes causality from the mask's function either way."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    class CausalBlocks(sm.CausalMask):
        def __getitem__(self, idx):
            q, kv = idx
            if isinstance(q, slice) and isinstance(kv, slice) and q.step in (None, 1) and kv.step in (None, 1):
                if kv.start > q.stop - 1:
                    return np.zeros((1, 1), bool)
                if kv.stop - 1 <= q.start:
                    return np.ones((1, 1), bool)
            return super().__getitem__(idx)

    return CausalBlocks((T, T))


def splash_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, *, interpret=None, block=512):
    """Pallas splash attention (causal + segment ids), one call per batch row. Needs T == S."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, T, H, _ = q_BTHK.shape
    if k_BSHK.shape[1] != T:
        raise ValueError(f"attention_kernel=flash: needs equal q and kv lengths, got {T} and {k_BSHK.shape[1]}")
    b = min(block, T)
    if T % b:
        raise ValueError(f"attention_kernel=flash: sequence length {T} must be a multiple of the block {b}")
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = sm.MultiHeadMask([causal_mask(T) for _ in range(H)])

    def attend(interp):
        kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interp)
        return jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=sk.SegmentIds(q=s1, kv=s1)))

    q = (q_BTHK.astype(jnp.float32) * scale).astype(q_BTHK.dtype).swapaxes(1, 2)
    k, v = k_BSHK.swapaxes(1, 2), v_BSHV.swapaxes(1, 2)
    seg = segment_BT.astype(jnp.int32)
    if interpret is None:  # decided for the platform lowered for (a CPU host may compile for TPU)
        o = jax.lax.platform_dependent(q, k, v, seg, tpu=attend(False), default=attend(True))
    else:
        o = attend(interpret)(q, k, v, seg)
    return o.swapaxes(1, 2).astype(q_BTHK.dtype)
