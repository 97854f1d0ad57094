"""Chunked simple GLA in pure JAX: the CPU default and the fallback everywhere.

Works on the prepared layout of `layout.prepare` (time padded to N*C, heads before time):
  q, k [B, H, T, K]; v, do [B, H, T, V]; per-token fp32 `aux` arrays [B, H, T]:
  b (log-decay cumsum within the chunk), doc (document index), alpha (e^{b_i} if token i
  still sees the state entering its chunk, else 0), w (e^{b_C - b_j} if token j reaches the
  state leaving its chunk, else 0). Chunk states S_c [B, H, N, K, V] are fp32; the backward
  recomputes them instead of keeping anything from the forward.
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size (I, J: query and key
positions within a chunk), K key dim, V value dim.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _chunks(x, C):
    """[B, H, T, ...] -> [B, H, N, C, ...]."""
    B, H, T = x.shape[:3]
    return x.reshape(B, H, T // C, C, *x.shape[3:])


def _ein(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=jnp.float32)


def _intra_decay(aux, C):
    """D [B, H, N, C, C]: e^{b_i - b_j} for j <= i in the same document, else 0 (masked before exp)."""
    b_BHNC, doc_BHNC = _chunks(aux["b"], C), _chunks(aux["doc"], C)
    causal_IJ = jnp.tril(jnp.ones((C, C), bool))
    mask_BHNIJ = causal_IJ & (doc_BHNC[..., :, None] == doc_BHNC[..., None, :])
    return jnp.exp(jnp.where(mask_BHNIJ, b_BHNC[..., :, None] - b_BHNC[..., None, :], -jnp.inf))


def _states(k_BHTK, v_BHTV, aux, h0_BHKV, C):
    """States entering each chunk [B, H, N, K, V] and the final state [B, H, K, V], fp32."""
    w_BHNC, alpha_BHNC = _chunks(aux["w"], C), _chunks(aux["alpha"], C)
    U_NBHKV = _ein("bhnc,bhnck,bhncv->nbhkv", w_BHNC, _chunks(k_BHTK, C), _chunks(v_BHTV, C))
    lam_NBH = jnp.moveaxis(alpha_BHNC[..., -1], -1, 0)  # decay over the chunk, 0 on a reset

    def step(S_BHKV, xs):
        U_BHKV, lam_BH = xs
        return lam_BH[..., None, None] * S_BHKV + U_BHKV, S_BHKV

    hT_BHKV, S_NBHKV = jax.lax.scan(step, h0_BHKV, (U_NBHKV, lam_NBH))
    return jnp.moveaxis(S_NBHKV, 0, 2), hT_BHKV


def forward(q, k, v, aux, h0, scale, C):
    """Returns o [B, H, T, V] fp32 and the final state [B, H, K, V] fp32."""
    S_BHNKV, hT_BHKV = _states(k, v, aux, h0, C)
    q_BHNIK, k_BHNJK, v_BHNJV = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    A_BHNIJ = _ein("bhnik,bhnjk->bhnij", q_BHNIK, k_BHNJK) * (scale * _intra_decay(aux, C))
    o_BHNIV = _ein("bhnij,bhnjv->bhniv", A_BHNIJ, v_BHNJV)
    o_BHNIV += (scale * _chunks(aux["alpha"], C))[..., None] * _ein("bhnik,bhnkv->bhniv", q_BHNIK, S_BHNKV)
    return o_BHNIV.reshape(v.shape), hT_BHKV


def backward(q, k, v, aux, h0, do, dhT, scale, C):
    """Returns dq, dk, dv (fp32, layout of q, k, v) and d h0 [B, H, K, V]."""
    S_BHNKV, _ = _states(k, v, aux, h0, C)
    q_BHNIK, k_BHNJK, v_BHNJV, do_BHNIV = _chunks(q, C), _chunks(k, C), _chunks(v, C), _chunks(do, C)
    alpha_BHNI, w_BHNJ = _chunks(aux["alpha"], C), _chunks(aux["w"], C)
    V_NBHKV = _ein("bhni,bhnik,bhniv->nbhkv", scale * alpha_BHNI, q_BHNIK, do_BHNIV)
    lam_NBH = jnp.moveaxis(alpha_BHNI[..., -1], -1, 0)

    def step(G_BHKV, xs):  # reverse sweep: G is dL/d(state leaving chunk c)
        V_BHKV, lam_BH = xs
        return lam_BH[..., None, None] * G_BHKV + V_BHKV, G_BHKV

    dh0_BHKV, G_NBHKV = jax.lax.scan(step, dhT.astype(jnp.float32), (V_NBHKV, lam_NBH), reverse=True)
    G_BHNKV = jnp.moveaxis(G_NBHKV, 0, 2)
    D_BHNIJ = scale * _intra_decay(aux, C)
    A_BHNIJ = _ein("bhnik,bhnjk->bhnij", q_BHNIK, k_BHNJK) * D_BHNIJ
    dA_BHNIJ = _ein("bhniv,bhnjv->bhnij", do_BHNIV, v_BHNJV) * D_BHNIJ
    dq_BHNIK = _ein("bhnij,bhnjk->bhnik", dA_BHNIJ, k_BHNJK)
    dq_BHNIK += (scale * alpha_BHNI)[..., None] * _ein("bhniv,bhnkv->bhnik", do_BHNIV, S_BHNKV)
    dk_BHNJK = (_ein("bhnij,bhnik->bhnjk", dA_BHNIJ, q_BHNIK)
                + w_BHNJ[..., None] * _ein("bhnjv,bhnkv->bhnjk", v_BHNJV, G_BHNKV))
    dv_BHNJV = (_ein("bhnij,bhniv->bhnjv", A_BHNIJ, do_BHNIV)
                + w_BHNJ[..., None] * _ein("bhnjk,bhnkv->bhnjv", k_BHNJK, G_BHNKV))
    return dq_BHNIK.reshape(q.shape), dk_BHNJK.reshape(k.shape), dv_BHNJV.reshape(v.shape), dh0_BHKV
