"""Causal, same-document softmax attention as plain einsums: the reference (`dot_product_attention` over the
[T, S] logits), the causal half by query blocks (`blocked_attention`) and a shard of queries against the whole
sequence (`context_attention`, context parallelism)."""

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -0.7 * float(np.finfo(np.float32).max)


def attention_mask(q_segment_BT, kv_segment_BS, q_index_BT, kv_index_BS):
    """[B, T, S] bool: key s is visible to query t when kv_index <= q_index and segments match."""
    causal = kv_index_BS[:, None, :] <= q_index_BT[:, :, None]
    same_doc = kv_segment_BS[:, None, :] == q_segment_BT[:, :, None]
    return causal & same_doc


def dot_product_attention(q_BTHK, k_BSHK, v_BSHV, mask_BTS, scale):
    """Plain softmax attention with fp32 logits and softmax. Returns [B, T, H, V] in q's dtype."""
    logits = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask_BTS[:, None], logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BSHV.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, v_BSHV, preferred_element_type=jnp.float32).astype(q_BTHK.dtype)


def blocked_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, block):
    """Causal attention that skips the all-masked blocks above the diagonal. Needs T == S.

    Query block [s, e) attends to keys [0, e) only; the mask inside is the usual causal and
    same-segment one, so the output equals dot_product_attention's (exp of a masked logit is 0).
    """
    T = q_BTHK.shape[1]
    if k_BSHK.shape[1] != T:
        raise ValueError(f"attention_kernel=blocked: needs equal q and kv lengths, got {T} and {k_BSHK.shape[1]}")
    index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_BT.shape)
    outs = []
    for s in range(0, T, block):
        e = min(s + block, T)
        mask = attention_mask(segment_BT[:, s:e], segment_BT[:, :e], index[:, s:e], index[:, :e])
        outs.append(dot_product_attention(q_BTHK[:, s:e], k_BSHK[:, :e], v_BSHV[:, :e], mask, scale))
    return jnp.concatenate(outs, axis=1)


def context_attention(q_BTHK, k_BSHK, v_BSHV, q_index_BT, q_segment_BT, kv_segment_BS, scale, block):
    """Causal, same-segment attention of a shard of queries against the whole sequence's keys (context
    parallelism): q at global indices `q_index_BT`, keys at 0..S-1. Runs per query block of `block` over
    all S keys (which keys a shard's queries may see depends on where the shard sits, unknown to a
    static slice), so it does the full T x S work rather than the causal half."""
    T, S = q_BTHK.shape[1], k_BSHK.shape[1]
    kv_index_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), kv_segment_BS.shape)
    outs = []
    for s in range(0, T, block):
        e = min(s + block, T)
        mask = attention_mask(q_segment_BT[:, s:e], kv_segment_BS, q_index_BT[:, s:e], kv_index_BS)
        outs.append(dot_product_attention(q_BTHK[:, s:e], k_BSHK, v_BSHV, mask, scale))
    return jnp.concatenate(outs, axis=1)
