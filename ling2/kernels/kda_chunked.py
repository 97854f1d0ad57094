"""Chunked Kimi Delta Attention in pure JAX (the WY / UT-transform form of fla's `chunk_kda`).

The per-chunk math is kda_chunk_math (the same code the Pallas kernels run), vmapped over batch,
heads and chunks; only the state recurrence across chunks is a lax.scan. Everything is computed
in the accumulation dtype (fp32; fp64 for fp64 inputs), bf16 inputs included.

Works on the prepared layout of `kda.prepare` (time padded to N*C, heads before time):
  q, k, g [B, H, T, K]; v, do [B, H, T, V]; beta [B, H, T]; aux (`kda.prepare_docs`): doc, first,
  last [B, 1, T] (document index; token shares the document of the state entering / leaving its chunk).
The backward recomputes the chunk states with a forward scan, sweeps dL/d(state) backwards with a
second scan (G_in = lam G + scale (q alpha)^T do - W^T (Aqk^T do) - W^T ((k omega) G)), and then
takes every chunk's gradients in parallel. Chunk states [B, H, N, K, V] are the only per-chunk
tensors kept; nothing per token is kept from the forward.
"""

import jax
import jax.numpy as jnp

from ling2.kernels import kda_chunk_math as chunk

_HI = jax.lax.Precision.HIGHEST


def _per_chunk(q, k, v, g, beta, aux, C, *extra):
    """Chunked views [B, H, N, C, D] (beta, doc, first, last as columns [.., C, 1], doc also as rows [.., 1, C])."""
    B, H, T = beta.shape
    N = T // C
    ch = lambda x: x.reshape(B, H, N, C, x.shape[-1])
    doc = jnp.broadcast_to(aux["doc"], (B, H, T)).reshape(B, H, N, C)
    col = lambda x: jnp.broadcast_to(x, (B, H, T)).reshape(B, H, N, C, 1)
    return (ch(q), ch(k), ch(v), ch(g), col(beta), doc[..., None], doc[..., None, :], col(aux["first"]),
            col(aux["last"])) + tuple(ch(x) for x in extra)


def _vmap3(f):
    return jax.vmap(jax.vmap(jax.vmap(f)))


def _prologue(chunks, scale, dots):
    return _vmap3(lambda *a: chunk.prologue(*a, scale, dots))(*chunks)


def _lead(x):
    return jnp.moveaxis(x, 2, 0)


def _states(kw, p, h0, dots):
    """States entering each chunk [B, H, N, K, V] and the final state [B, H, K, V]."""
    step1 = jax.vmap(jax.vmap(lambda S, kw, U, W, lam: chunk.state_step(S, kw, U, W, lam, dots)[1]))

    def step(S, xs):
        return step1(S, *xs), S

    hT, S_in = jax.lax.scan(step, h0, tuple(_lead(x) for x in (kw, p["U"], p["W"], p["lam"])))
    return jnp.moveaxis(S_in, 0, 2), hT


def forward(q, k, v, g, beta, aux, h0, scale, C):
    """Returns o [B, H, T, V] and the final state [B, H, K, V], in the accumulation dtype."""
    dots = chunk.Dots(h0.dtype)
    chunks = _per_chunk(*(x.astype(h0.dtype) for x in (q, k, v, g, beta)), aux, C)
    p = _prologue(chunks, scale, dots)
    qc, kc = chunks[:2]
    S, hT = _states(kc * p["omega"], p, h0, dots)
    out = lambda q, alpha, Aqk, S, U, W: chunk.output(q, alpha, Aqk, S, U - dots.data(W, S), scale, dots)
    o = _vmap3(out)(qc, p["alpha"], p["Aqk"], S, p["U"], p["W"])
    return o.reshape(v.shape), hT


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C):
    """Returns dq, dk, dv, dg (layout of q, k, v, g), dbeta [B, H, T] and d h0, in the accumulation dtype."""
    acc = h0.dtype
    dots = chunk.Dots(acc)
    chunks = _per_chunk(*(x.astype(acc) for x in (q, k, v, g, beta)), aux, C, do.astype(acc))
    p = _prologue(chunks[:-1], scale, dots)
    qc, kc, doc_ = chunks[0], chunks[1], chunks[-1]
    kw = kc * p["omega"]
    S, _ = _states(kw, p, h0, dots)

    ein = lambda spec, *xs: jnp.einsum(spec, *xs, precision=_HI)
    Vc = scale * ein("...ck,...cv->...kv", qc * p["alpha"], doc_) - ein(
        "...ck,...ic,...iv->...kv", p["W"], p["Aqk"], doc_)

    def step(G, xs):  # reverse sweep: G = dL/d(state leaving chunk c)
        kw_c, W_c, lam_c, V_c = xs
        G_in = lam_c * G - ein("bhck,bhcv->bhkv", W_c, ein("bhck,bhkv->bhcv", kw_c, G)) + V_c
        return G_in, G

    dh0, G = jax.lax.scan(step, dhT.astype(acc), (_lead(kw), _lead(p["W"]), _lead(p["lam"]), _lead(Vc)),
                          reverse=True)
    G = jnp.moveaxis(G, 0, 2)  # [B, H, N, K, V]
    grads = _vmap3(lambda *a: chunk.backward(*a[:9], a[10], a[11], a[9], scale, dots, pre=a[12]))
    dq, dk, dv, dg, dbeta, _ = grads(*chunks, S, G, p)
    B, H, T = beta.shape
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            dbeta.reshape(B, H, T), dh0)
