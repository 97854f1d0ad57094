"""Chunked Kimi Delta Attention in pure JAX (the WY / UT-transform form of fla's `chunk_kda`).

The per-chunk math is chunk_math (the same code the Pallas kernels run), vmapped over batch,
heads and chunks; only the state recurrence across chunks is a lax.scan. Everything is computed
in the accumulation dtype (fp32; fp64 for fp64 inputs), bf16 inputs included.

Works on the prepared layout of `layout.prepare` (time padded to N*C, heads before time):
  q, k, g [B, H, T, K]; v, do [B, H, T, V]; beta [B, H, T]; aux (`op.prepare_docs`): doc, first,
  last [B, 1, T] (document index; token shares the document of the state entering / leaving its chunk).
The backward recomputes the chunk states with a forward scan, sweeps dL/d(state) backwards with a
second scan (G_in = lam G + scale (q alpha)^T do - W^T (Aqk^T do) - W^T ((k omega) G)), and then
takes every chunk's gradients in parallel. Chunk states [B, H, N, K, V] are the only per-chunk
tensors kept; nothing per token is kept from the forward.
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, K key dim, V value dim,
D either head dim.
"""

import jax
import jax.numpy as jnp

from ling2.kernels.kda import chunk_math as chunk

_HI = jax.lax.Precision.HIGHEST


def per_chunk(q_BHTK, k_BHTK, v_BHTV, g_BHTK, beta_BHT, aux, C, *extra):
    """Chunked views [B, H, N, C, D] (beta, doc, first, last as columns [.., C, 1], doc also as rows [.., 1, C])."""
    B, H, T = beta_BHT.shape
    N = T // C
    ch = lambda x_BHTD: x_BHTD.reshape(B, H, N, C, x_BHTD.shape[-1])
    doc_BHNC = jnp.broadcast_to(aux["doc"], (B, H, T)).reshape(B, H, N, C)
    col = lambda x: jnp.broadcast_to(x, (B, H, T)).reshape(B, H, N, C, 1)
    return (ch(q_BHTK), ch(k_BHTK), ch(v_BHTV), ch(g_BHTK), col(beta_BHT), doc_BHNC[..., None], doc_BHNC[..., None, :],
            col(aux["first"]), col(aux["last"])) + tuple(ch(x) for x in extra)


def vmap3(f):
    return jax.vmap(jax.vmap(jax.vmap(f)))


def prologue(chunks, scale, dots):
    """chunk_math.prologue of every chunk at once: a dict of [B, H, N, ...] arrays."""
    return vmap3(lambda *a: chunk.prologue(*a, scale, dots))(*chunks)


def _lead(x):
    """[B, H, N, ...] -> [N, B, H, ...]."""
    return jnp.moveaxis(x, 2, 0)


def _states(kw_BHNCK, p, h0_BHKV, dots):
    """States entering each chunk [B, H, N, K, V] and the final state [B, H, K, V]."""
    step1 = jax.vmap(jax.vmap(lambda S, kw, U, W, lam: chunk.state_step(S, kw, U, W, lam, dots)[1]))

    def step(S_BHKV, xs):
        return step1(S_BHKV, *xs), S_BHKV

    hT_BHKV, S_NBHKV = jax.lax.scan(step, h0_BHKV, tuple(_lead(x) for x in (kw_BHNCK, p["U"], p["W"], p["lam"])))
    return jnp.moveaxis(S_NBHKV, 0, 2), hT_BHKV


def forward(q, k, v, g, beta, aux, h0, scale, C):
    """Returns o [B, H, T, V] and the final state [B, H, K, V], in the accumulation dtype."""
    dots = chunk.Dots(h0.dtype)
    chunks = per_chunk(*(x.astype(h0.dtype) for x in (q, k, v, g, beta)), aux, C)
    p = prologue(chunks, scale, dots)
    q_BHNCK, k_BHNCK = chunks[:2]
    S_BHNKV, hT_BHKV = _states(k_BHNCK * p["omega"], p, h0, dots)
    out = lambda q, alpha, Aqk, S, U, W: chunk.output(q, alpha, Aqk, S, U - dots.data(W, S), scale, dots)
    o_BHNCV = vmap3(out)(q_BHNCK, p["alpha"], p["Aqk"], S_BHNKV, p["U"], p["W"])
    return o_BHNCV.reshape(v.shape), hT_BHKV


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C):
    """Returns dq, dk, dv, dg (layout of q, k, v, g), dbeta [B, H, T] and d h0, in the accumulation dtype."""
    acc = h0.dtype
    dots = chunk.Dots(acc)
    chunks = per_chunk(*(x.astype(acc) for x in (q, k, v, g, beta)), aux, C, do.astype(acc))
    p = prologue(chunks[:-1], scale, dots)
    q_BHNCK, k_BHNCK, do_BHNCV = chunks[0], chunks[1], chunks[-1]
    kw_BHNCK = k_BHNCK * p["omega"]
    S_BHNKV, _ = _states(kw_BHNCK, p, h0, dots)

    ein = lambda spec, *xs: jnp.einsum(spec, *xs, precision=_HI)
    V_BHNKV = scale * ein("...ck,...cv->...kv", q_BHNCK * p["alpha"], do_BHNCV) - ein(
        "...ck,...ic,...iv->...kv", p["W"], p["Aqk"], do_BHNCV)

    def step(G_BHKV, xs):  # reverse sweep: G = dL/d(state leaving chunk c)
        kw_BHCK, W_BHCK, lam_BHKV, V_BHKV = xs
        G_in_BHKV = (lam_BHKV * G_BHKV - ein("bhck,bhcv->bhkv", W_BHCK, ein("bhck,bhkv->bhcv", kw_BHCK, G_BHKV))
                     + V_BHKV)
        return G_in_BHKV, G_BHKV

    dh0_BHKV, G_NBHKV = jax.lax.scan(
        step, dhT.astype(acc), (_lead(kw_BHNCK), _lead(p["W"]), _lead(p["lam"]), _lead(V_BHNKV)), reverse=True)
    G_BHNKV = jnp.moveaxis(G_NBHKV, 0, 2)
    grads = vmap3(lambda *a: chunk.backward(*a[:9], a[10], a[11], a[9], scale, dots, pre=a[12]))
    dq_BHNCK, dk_BHNCK, dv_BHNCV, dg_BHNCK, dbeta_BHNC1, _ = grads(*chunks, S_BHNKV, G_BHNKV, p)
    B, H, T = beta.shape
    return (dq_BHNCK.reshape(q.shape), dk_BHNCK.reshape(k.shape), dv_BHNCV.reshape(v.shape),
            dg_BHNCK.reshape(g.shape), dbeta_BHNC1.reshape(B, H, T), dh0_BHKV)
