"""Per-token oracle for Kimi Delta Attention (KDA): the recurrence itself, autodiff only.

One head, per-key-dim log gate g_t <= 0, scalar beta_t, scale sigma (ling3.md fact 4):
    S <- diag(exp(g_t)) S              (S := 0 first at the start of a new document)
    S <- S + k_t^T (beta_t (v_t - k_t S))
    o_t = sigma q_t S
Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H]; doc [B, T] int32
non-decreasing document index; h0 [B, H, K, V]. The initial state belongs to the first document.
Computes in fp32 (fp64 for fp64 inputs).
Axes in names: B batch, T time, H heads, K key dim, V value dim.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def acc_dtype(dtype):
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 inputs (tests run the kernels in fp64)."""
    return jnp.promote_types(dtype, jnp.float32)


def step(S_BHKV, q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, reset_B, scale):
    """One token: (o_t [B, H, V], new state [B, H, K, V]); all inputs already in the state's dtype."""
    keep_BHK = jnp.where(reset_B[:, None, None], 0.0, jnp.exp(g_BHK))
    S_BHKV = keep_BHK[..., None] * S_BHKV
    kS_BHV = jnp.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV, precision=_HI)
    S_BHKV = S_BHKV + k_BHK[..., :, None] * (beta_BH[..., None] * (v_BHV - kS_BHV))[..., None, :]
    o_BHV = scale * jnp.einsum("bhk,bhkv->bhv", q_BHK, S_BHKV, precision=_HI)
    return o_BHV, S_BHKV


def naive_recurrence(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, doc_BT, h0_BHKV, scale):
    """lax.scan over T. Returns (o [B, T, H, V], final state [B, H, K, V]) in the accumulation dtype."""
    acc = acc_dtype(q_BTHK.dtype)
    q_TBHK, k_TBHK, v_TBHV, g_TBHK = (x.astype(acc).swapaxes(0, 1) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK))
    beta_TBH = beta_BTH.astype(acc).swapaxes(0, 1)
    new_doc_BT = jnp.concatenate([jnp.zeros_like(doc_BT[:, :1]), doc_BT[:, 1:] != doc_BT[:, :-1]], axis=1)
    new_doc_TB = new_doc_BT.swapaxes(0, 1).astype(bool)

    def body(S_BHKV, xs):
        q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, reset_B = xs
        o_BHV, S_BHKV = step(S_BHKV, q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, reset_B, scale)
        return S_BHKV, o_BHV

    hT_BHKV, o_TBHV = jax.lax.scan(body, h0_BHKV.astype(acc), (q_TBHK, k_TBHK, v_TBHV, g_TBHK, beta_TBH, new_doc_TB))
    return o_TBHV.swapaxes(0, 1), hT_BHKV
