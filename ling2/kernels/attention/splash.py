"""Pallas splash attention (TPU) for the causal, packed-document case: one call per batch row
(`splash_attention`), and the causal masks with a fast block summary that splash's host-side tables need:
`causal_mask` (queries in order) and `zigzag_causal_mask` (queries in the balanced context-parallel layout of
`ling2.kernels.attention.context`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ling2.kernels.attention.context import zigzag_chunk


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


def zigzag_position(r, T: int, n: int):
    """The sequence position of row r (numpy or jax ints) when T queries sit in the zigzag layout of n shards:
    shard d's T/n rows are the even chunk of {d, 2n-1-d} (chunks of T/2n), then the odd one, as
    `ling2.kernels.attention.context.to_zigzag` moves them. Integer arithmetic only, so the kernel can
    evaluate it too."""
    C = T // (2 * n)
    return zigzag_chunk(r // (2 * C), (r // C) % 2, n) * C + r % C


@functools.cache
def zigzag_causal_mask(T: int, n: int):
    """splash's causal mask of [T, T] with the rows in the zigzag layout of n shards (`zigzag_position`): with
    `q_seq_shards` = n each device's rows are its two chunks, and every device skips the same number of
    blocks. The fast block summary of `causal_mask`, for blocks inside one chunk."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    C = T // (2 * n)

    class ZigzagCausal(sm._ComputableMask):
        def __init__(self):
            super().__init__((T, T), lambda q_ids, kv_ids: zigzag_position(q_ids, T, n) >= kv_ids, shard_count=n)

        def __eq__(self, other):
            return isinstance(other, ZigzagCausal) and other.shape == self.shape

        def __hash__(self):
            return hash(("zigzag_causal", T, n))

        def __getitem__(self, idx):
            q, kv = idx
            if (isinstance(q, slice) and isinstance(kv, slice) and q.step in (None, 1) and kv.step in (None, 1)
                    and q.start // C == (q.stop - 1) // C):
                first, last = int(zigzag_position(q.start, T, n)), int(zigzag_position(q.stop - 1, T, n))
                if kv.start > last:
                    return np.zeros((1, 1), bool)
                if kv.stop - 1 <= first:
                    return np.ones((1, 1), bool)
            return super().__getitem__(idx)

    return ZigzagCausal()


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
