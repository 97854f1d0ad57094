"""Chunked simple GLA in pure JAX: the CPU default and the fallback everywhere.

Works on the prepared layout of `gla.prepare` (time padded to N*C, heads before time):
  q, k [B, H, T, K]; v, do [B, H, T, V]; per-token fp32 `aux` arrays [B, H, T]:
  b (log-decay cumsum within the chunk), doc (document index), alpha (e^{b_i} if token i
  still sees the state entering its chunk, else 0), w (e^{b_C - b_j} if token j reaches the
  state leaving its chunk, else 0). Chunk states S_c [B, H, N, K, V] are fp32; the backward
  recomputes them instead of keeping anything from the forward.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _chunks(x, C):
    B, H, T = x.shape[:3]
    return x.reshape(B, H, T // C, C, *x.shape[3:])


def _ein(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI, preferred_element_type=jnp.float32)


def _intra_decay(aux, C):
    """D [B, H, N, C, C]: e^{b_i - b_j} for j <= i in the same document, else 0 (masked before exp)."""
    b, doc = _chunks(aux["b"], C), _chunks(aux["doc"], C)
    causal = jnp.tril(jnp.ones((C, C), bool))
    mask = causal & (doc[..., :, None] == doc[..., None, :])
    return jnp.exp(jnp.where(mask, b[..., :, None] - b[..., None, :], -jnp.inf))


def _states(k, v, aux, h0, C):
    """States entering each chunk [B, H, N, K, V] and the final state [B, H, K, V], fp32."""
    w, alpha = _chunks(aux["w"], C), _chunks(aux["alpha"], C)
    U = _ein("bhnc,bhnck,bhncv->nbhkv", w, _chunks(k, C), _chunks(v, C))
    lam = jnp.moveaxis(alpha[..., -1], -1, 0)  # [N, B, H]: decay over the chunk, 0 on a reset

    def step(S, xs):
        U_c, lam_c = xs
        return lam_c[..., None, None] * S + U_c, S

    hT, S_in = jax.lax.scan(step, h0, (U, lam))
    return jnp.moveaxis(S_in, 0, 2), hT


def forward(q, k, v, aux, h0, scale, C):
    """Returns o [B, H, T, V] fp32 and the final state [B, H, K, V] fp32."""
    S, hT = _states(k, v, aux, h0, C)
    qc, kc, vc = _chunks(q, C), _chunks(k, C), _chunks(v, C)
    A = _ein("bhnik,bhnjk->bhnij", qc, kc) * (scale * _intra_decay(aux, C))
    o = _ein("bhnij,bhnjv->bhniv", A, vc)
    o += (scale * _chunks(aux["alpha"], C))[..., None] * _ein("bhnik,bhnkv->bhniv", qc, S)
    return o.reshape(v.shape), hT


def backward(q, k, v, aux, h0, do, dhT, scale, C):
    """Returns dq, dk, dv (fp32, layout of q, k, v) and d h0 [B, H, K, V]."""
    S, _ = _states(k, v, aux, h0, C)
    qc, kc, vc, doc_ = _chunks(q, C), _chunks(k, C), _chunks(v, C), _chunks(do, C)
    alpha, w = _chunks(aux["alpha"], C), _chunks(aux["w"], C)
    V = _ein("bhni,bhnik,bhniv->nbhkv", scale * alpha, qc, doc_)
    lam = jnp.moveaxis(alpha[..., -1], -1, 0)

    def step(G, xs):  # reverse sweep: G is dL/d(state leaving chunk c)
        V_c, lam_c = xs
        return lam_c[..., None, None] * G + V_c, G

    dh0, G_out = jax.lax.scan(step, dhT.astype(jnp.float32), (V, lam), reverse=True)
    G_out = jnp.moveaxis(G_out, 0, 2)  # [B, H, N, K, V]
    D = scale * _intra_decay(aux, C)
    A = _ein("bhnik,bhnjk->bhnij", qc, kc) * D
    dA = _ein("bhniv,bhnjv->bhnij", doc_, vc) * D
    dq = _ein("bhnij,bhnjk->bhnik", dA, kc)
    dq += (scale * alpha)[..., None] * _ein("bhniv,bhnkv->bhnik", doc_, S)
    dk = _ein("bhnij,bhnik->bhnjk", dA, qc) + w[..., None] * _ein("bhnjv,bhnkv->bhnjk", vc, G_out)
    dv = _ein("bhnij,bhniv->bhnjv", A, doc_) + w[..., None] * _ein("bhnjk,bhnkv->bhnjv", kc, G_out)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dh0
