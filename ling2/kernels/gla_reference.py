"""Plain oracles for simple gated linear attention (no chunking, autodiff only).

Both follow the recurrence of model.md, one head, scale sigma, current token included:
    S_t = exp(g_t) * S_{t-1} + k_t^T v_t   (S_{t-1} := 0 at the start of a new document)
    o_t = sigma * q_t S_t
Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] fp32 log-decay (<= 0);
doc [B, T] int32 non-decreasing document index; h0 [B, H, K, V] fp32.
The initial state belongs to the first document of each row.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def naive_recurrence(q, k, v, g, doc, h0, scale):
    """Per-token lax.scan over T. Returns (o [B,T,H,V] fp32, final state [B,H,K,V] fp32)."""
    f32 = jnp.float32
    q, k, v = (x.astype(f32).swapaxes(0, 1) for x in (q, k, v))  # [T, B, H, D]
    g = g.astype(f32).swapaxes(0, 1)  # [T, B, H]
    new_doc = jnp.concatenate([jnp.zeros_like(doc[:, :1]), doc[:, 1:] != doc[:, :-1]], axis=1)
    new_doc = new_doc.swapaxes(0, 1).astype(bool)  # [T, B]

    def step(S_BHKV, xs):
        q_t, k_t, v_t, g_t, reset_t = xs
        decay = jnp.where(reset_t[:, None], 0.0, jnp.exp(g_t))  # [B, H]
        S_BHKV = decay[..., None, None] * S_BHKV + k_t[..., :, None] * v_t[..., None, :]
        o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, S_BHKV, precision=_HI)
        return S_BHKV, o_t

    hT, o = jax.lax.scan(step, h0.astype(f32), (q, k, v, g, new_doc))
    return o.swapaxes(0, 1), hT


def quadratic(q, k, v, g, doc, h0, scale):
    """Masked T x T form with global cumulative log-decay. O(T^2): an oracle for short T."""
    f32 = jnp.float32
    q, k, v = (x.astype(f32) for x in (q, k, v))
    T = q.shape[1]
    cum_BHT = jnp.cumsum(g.astype(f32), axis=1).swapaxes(1, 2)  # [B, H, T]
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = doc[:, :, None] == doc[:, None, :]  # [B, T, T]
    mask = (causal[None] & same)[:, None]  # [B, 1, T, T]
    diff = cum_BHT[..., :, None] - cum_BHT[..., None, :]
    decay_BHTT = jnp.exp(jnp.where(mask, diff, -jnp.inf))
    att = jnp.einsum("bthk,bshk->bhts", q, k, precision=_HI) * decay_BHTT
    o = scale * jnp.einsum("bhts,bshv->bthv", att, v, precision=_HI)
    first = (doc == doc[:, :1])[:, None, :]  # [B, 1, T]: tokens that still see h0
    from_h0 = jnp.exp(jnp.where(first, cum_BHT, -jnp.inf))  # [B, H, T]
    o += scale * jnp.einsum("bht,bthk,bhkv->bthv", from_h0, q, h0.astype(f32), precision=_HI)
    last = (doc == doc[:, -1:])[:, None, :]  # [B, 1, T]: tokens of the last document
    to_end = jnp.exp(jnp.where(last, cum_BHT[..., -1:] - cum_BHT, -jnp.inf))  # [B, H, T]
    hT = jnp.einsum("bht,bthk,bthv->bhkv", to_end, k, v, precision=_HI)
    keep_h0 = jnp.where((doc[:, -1] == doc[:, 0])[:, None], jnp.exp(cum_BHT[..., -1]), 0.0)  # [B, H]
    hT += keep_h0[..., None, None] * h0.astype(f32)
    return o, hT
