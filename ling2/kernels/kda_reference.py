"""Per-token oracle for Kimi Delta Attention (KDA): the recurrence itself, autodiff only.

One head, per-key-dim log gate g_t <= 0, scalar beta_t, scale sigma (ling3.md fact 4):
    S <- diag(exp(g_t)) S              (S := 0 first at the start of a new document)
    S <- S + k_t^T (beta_t (v_t - k_t S))
    o_t = sigma q_t S
Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]; beta [B, T, H]; doc [B, T] int32
non-decreasing document index; h0 [B, H, K, V]. The initial state belongs to the first document.
Computes in fp32 (fp64 for fp64 inputs).
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def acc_dtype(dtype):
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 inputs (tests run the kernels in fp64)."""
    return jnp.promote_types(dtype, jnp.float32)


def step(S_BHKV, q_t, k_t, v_t, g_t, beta_t, reset_B, scale):
    """One token: (o_t [B, H, V], new state [B, H, K, V]); all inputs already in the state's dtype."""
    keep = jnp.where(reset_B[:, None, None], 0.0, jnp.exp(g_t))  # [B, H, K]
    S_BHKV = keep[..., None] * S_BHKV
    kS = jnp.einsum("bhk,bhkv->bhv", k_t, S_BHKV, precision=_HI)
    S_BHKV = S_BHKV + k_t[..., :, None] * (beta_t[..., None] * (v_t - kS))[..., None, :]
    o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, S_BHKV, precision=_HI)
    return o_t, S_BHKV


def naive_recurrence(q, k, v, g, beta, doc, h0, scale):
    """lax.scan over T. Returns (o [B, T, H, V], final state [B, H, K, V]) in the accumulation dtype."""
    acc = acc_dtype(q.dtype)
    q, k, v, g = (x.astype(acc).swapaxes(0, 1) for x in (q, k, v, g))  # [T, B, H, D]
    beta = beta.astype(acc).swapaxes(0, 1)  # [T, B, H]
    new_doc = jnp.concatenate([jnp.zeros_like(doc[:, :1]), doc[:, 1:] != doc[:, :-1]], axis=1)
    new_doc = new_doc.swapaxes(0, 1).astype(bool)  # [T, B]

    def body(S, xs):
        q_t, k_t, v_t, g_t, beta_t, reset_t = xs
        o_t, S = step(S, q_t, k_t, v_t, g_t, beta_t, reset_t, scale)
        return S, o_t

    hT, o = jax.lax.scan(body, h0.astype(acc), (q, k, v, g, beta, new_doc))
    return o.swapaxes(0, 1), hT
