"""Plain oracles for simple gated linear attention (no chunking, autodiff only).

Both follow the recurrence of model.md, one head, scale sigma, current token included:
    S_t = exp(g_t) * S_{t-1} + k_t^T v_t   (S_{t-1} := 0 at the start of a new document)
    o_t = sigma * q_t S_t
Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] fp32 log-decay (<= 0);
doc [B, T] int32 non-decreasing document index; h0 [B, H, K, V] fp32.
The initial state belongs to the first document of each row.
Axes in names: B batch, T time (S: a second time axis), H heads, K key dim, V value dim.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def naive_recurrence(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale):
    """Per-token lax.scan over T. Returns (o [B,T,H,V] fp32, final state [B,H,K,V] fp32)."""
    f32 = jnp.float32
    q_TBHK, k_TBHK, v_TBHV = (x.astype(f32).swapaxes(0, 1) for x in (q_BTHK, k_BTHK, v_BTHV))
    g_TBH = g_BTH.astype(f32).swapaxes(0, 1)
    new_doc_BT = jnp.concatenate([jnp.zeros_like(doc_BT[:, :1]), doc_BT[:, 1:] != doc_BT[:, :-1]], axis=1)
    new_doc_TB = new_doc_BT.swapaxes(0, 1).astype(bool)

    def step(S_BHKV, xs):
        q_BHK, k_BHK, v_BHV, g_BH, reset_B = xs
        decay_BH = jnp.where(reset_B[:, None], 0.0, jnp.exp(g_BH))
        S_BHKV = decay_BH[..., None, None] * S_BHKV + k_BHK[..., :, None] * v_BHV[..., None, :]
        o_BHV = scale * jnp.einsum("bhk,bhkv->bhv", q_BHK, S_BHKV, precision=_HI)
        return S_BHKV, o_BHV

    hT_BHKV, o_TBHV = jax.lax.scan(step, h0_BHKV.astype(f32), (q_TBHK, k_TBHK, v_TBHV, g_TBH, new_doc_TB))
    return o_TBHV.swapaxes(0, 1), hT_BHKV


def quadratic(q_BTHK, k_BTHK, v_BTHV, g_BTH, doc_BT, h0_BHKV, scale):
    """Masked T x T form with global cumulative log-decay. O(T^2): an oracle for short T."""
    f32 = jnp.float32
    q_BTHK, k_BTHK, v_BTHV = (x.astype(f32) for x in (q_BTHK, k_BTHK, v_BTHV))
    h0_BHKV = h0_BHKV.astype(f32)
    T = q_BTHK.shape[1]
    cum_BHT = jnp.cumsum(g_BTH.astype(f32), axis=1).swapaxes(1, 2)
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    same_BTS = doc_BT[:, :, None] == doc_BT[:, None, :]
    mask_B1TS = (causal_TS[None] & same_BTS)[:, None]
    diff_BHTS = cum_BHT[..., :, None] - cum_BHT[..., None, :]
    decay_BHTS = jnp.exp(jnp.where(mask_B1TS, diff_BHTS, -jnp.inf))
    att_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BTHK, precision=_HI) * decay_BHTS
    o_BTHV = scale * jnp.einsum("bhts,bshv->bthv", att_BHTS, v_BTHV, precision=_HI)
    first_B1T = (doc_BT == doc_BT[:, :1])[:, None, :]  # tokens that still see h0
    from_h0_BHT = jnp.exp(jnp.where(first_B1T, cum_BHT, -jnp.inf))
    o_BTHV += scale * jnp.einsum("bht,bthk,bhkv->bthv", from_h0_BHT, q_BTHK, h0_BHKV, precision=_HI)
    last_B1T = (doc_BT == doc_BT[:, -1:])[:, None, :]  # tokens of the last document
    to_end_BHT = jnp.exp(jnp.where(last_B1T, cum_BHT[..., -1:] - cum_BHT, -jnp.inf))
    hT_BHKV = jnp.einsum("bht,bthk,bthv->bhkv", to_end_BHT, k_BTHK, v_BTHV, precision=_HI)
    keep_h0_BH = jnp.where((doc_BT[:, -1] == doc_BT[:, 0])[:, None], jnp.exp(cum_BHT[..., -1]), 0.0)
    hT_BHKV += keep_h0_BH[..., None, None] * h0_BHKV
    return o_BTHV, hT_BHKV
