"""Causal, same-document softmax attention as plain einsums: the reference (`dot_product_attention` over the
[T, S] logits) and the causal half by query blocks (`blocked_attention`). A context shard's queries against
the whole sequence: `ling2.kernels.attention.context`."""

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
