"""Pallas GPU (Triton) kernels for chunked KDA: the recurrence across chunks, and only that.

Everything of a chunk that does not need the state (chunk_math.prologue: the intra-chunk
products, the (I + A)^-1 solve, U, W and the decays) and every chunk's gradients given its states
are independent across chunks, so they run for all chunks at once as batched XLA (chunked's
vmapped math), where the GPU has B x H x N-way parallelism for them. What is sequential is a few
matmuls per chunk, and those run as Triton kernels on grid (B, H, V / BLOCK_V), each program looping
over the N chunks with its fp32 slice of the state (K x BLOCK_V) in registers:
  forward: delta = U - W S;  o = scale (q alpha) S + Aqk delta;  S <- lam S + (k omega)^T delta
           (o and the final state; for the backward, the state entering every chunk instead).
  reverse: G <- lam G - W^T ((k omega) G) + Vc, with G = dL/d(state leaving the chunk) and
           Vc = scale (q alpha)^T do - W^T (Aqk^T do) batched beforehand (G of every chunk, d h0).
(Running the whole chunk math inside the sequential loop instead keeps a dozen [C, K] fp32 tiles
live per program on only B x H x V / BLOCK_V programs: 59x fla's forward time on an H200,
tools/bench/kda/NOTES.md.)
Precision as the other backends' bf16 path (chunk_math.Dots with TF32 for the decay products
and the solve): data matmuls take operands in the input dtype, the state and accumulation are fp32.
Triton needs power-of-two block shapes: K and V are zero-padded up to one (exact: padded key dims
have zero k, W and lam) and the chunk size is a power of two >= 16.
Kernel refs hold one head's whole sequence: qa (q alpha), W, kw (k omega) [T, K]; Aqk [T, C]; U, o
[T, BLOCK_V]; lam [N, K]; states and their gradients [K, BLOCK_V] ([N, K, BLOCK_V] per chunk).
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, K key dim, V value dim
(or a block of it).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling2.kernels import vma
from ling2.kernels.kda import chunk_math as chunk
from ling2.kernels.kda import chunked
from ling2.kernels.triton_blocks import dot, grid_call, pad_last, pad_state, pow2

_HI = jax.lax.Precision.HIGHEST
BLOCK_V = 64  # state columns per program


def _dots(dt):
    return chunk.Dots(dt, mid_low=jax.lax.Precision.HIGH)  # TF32 for the decay products and the inverse


def _chunk(n, C):
    return pl.ds(pl.multiple_of(n * C, C), C)


def _fwd_kernel(qa_ref, A_ref, U_ref, W_ref, kw_ref, lam_ref, h0_ref, o_ref, hT_ref, *, scale, C):
    dt = qa_ref.dtype

    def body(n, S_KV):
        s = _chunk(n, C)
        delta_CV = U_ref[s, :] - dot(W_ref[s, :], S_KV, dt)
        o_ref[s, :] = (scale * dot(qa_ref[s, :], S_KV, dt) + dot(A_ref[s, :], delta_CV, dt)).astype(o_ref.dtype)
        return lam_ref[n, :][:, None] * S_KV + dot(kw_ref[s, :], delta_CV, dt, ta=True)

    hT_ref[...] = jax.lax.fori_loop(0, U_ref.shape[0] // C, body, h0_ref[...])


def _states_kernel(U_ref, W_ref, kw_ref, lam_ref, h0_ref, Sin_ref, *, C):
    dt = W_ref.dtype

    def body(n, S_KV):
        s = _chunk(n, C)
        Sin_ref[n] = S_KV
        delta_CV = U_ref[s, :] - dot(W_ref[s, :], S_KV, dt)
        return lam_ref[n, :][:, None] * S_KV + dot(kw_ref[s, :], delta_CV, dt, ta=True)

    jax.lax.fori_loop(0, U_ref.shape[0] // C, body, h0_ref[...])


def _reverse_kernel(W_ref, kw_ref, lam_ref, Vc_ref, dhT_ref, G_ref, dh0_ref, *, C):
    dt = W_ref.dtype
    N = W_ref.shape[0] // C

    def body(r, G_KV):
        n = N - 1 - r
        s = _chunk(n, C)
        G_ref[n] = G_KV
        kG_CV = dot(kw_ref[s, :], G_KV, dt)
        return lam_ref[n, :][:, None] * G_KV - dot(W_ref[s, :], kG_CV, dt, ta=True) + Vc_ref[n]

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])


def _check(C):
    if C < 16 or C & (C - 1):
        raise ValueError(f"pallas_gpu: chunk_size={C} must be a power of two >= 16 (Triton block shapes)")


def _sweep_inputs(q, k, v, g, beta, aux, scale, C, *extra):
    """The batched prologue of every chunk, and the sweep operands padded for Triton: qa, W, kw [B, H, T, K]
    and Aqk [B, H, T, C] in q's dtype, U [B, H, T, V] and lam [B, H, N, K] fp32."""
    dt = q.dtype
    B, H, T, K0 = q.shape
    K, V = pow2(K0), pow2(v.shape[-1])
    chunks = chunked.per_chunk(q, k, v, g, beta, aux, C, *extra)
    p = chunked.prologue(chunks[:9], scale, _dots(dt))
    flat = lambda x_BHNCD: x_BHNCD.reshape(B, H, T, x_BHNCD.shape[-1])
    tk = lambda x_BHNCK: pad_last(flat(x_BHNCK).astype(dt), K)
    ops = dict(qa=tk(chunks[0] * p["alpha"]), W=tk(p["W"]), kw=tk(chunks[1] * p["omega"]),
               A=flat(p["Aqk"]).astype(dt), U=pad_last(flat(p["U"]).astype(jnp.float32), V),
               lam=pad_last(p["lam"][..., 0].astype(jnp.float32), K))
    return chunks, p, ops, K, V


def _block(V, block_v):
    return min(V, block_v or BLOCK_V)


def forward(q, k, v, g, beta, aux, h0, scale, C, *, interpret=False, block_v=None):
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    _, _, ops, K, V = _sweep_inputs(q, k, v, g, beta, aux, scale, C)
    outs = [vma.out_struct((B, H, T, V), q.dtype, q), vma.out_struct((B, H, K, V), jnp.float32, q)]
    args = tuple(ops[n] for n in ("qa", "A", "U", "W", "kw", "lam")) + (pad_state(h0, K, V),)
    o_BHTV, hT_BHKV = grid_call(functools.partial(_fwd_kernel, scale=scale, C=C), args, outs,
                            ("full", "full", "v", "full", "full", "full", "v", "v", "v"), _block(V, block_v), interpret)
    return o_BHTV[..., :V0], hT_BHKV[:, :, :K0, :V0].astype(h0.dtype)


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C, *, interpret=False, block_v=None):
    """States entering every chunk (forward sweep), dL/d(state leaving every chunk) (reverse sweep), then
    every chunk's gradients at once."""
    _check(C)
    B, H, T, K0 = q.shape
    V0, N = v.shape[-1], T // C
    f32, dt = jnp.float32, q.dtype
    chunks, p, ops, K, V = _sweep_inputs(q, k, v, g, beta, aux, scale, C, do)
    BV = _block(V, block_v)
    S_BHNKV = grid_call(functools.partial(_states_kernel, C=C),
                    (ops["U"], ops["W"], ops["kw"], ops["lam"], pad_state(h0, K, V)),
                    [vma.out_struct((B, H, N, K, V), f32, q)], ("v", "full", "full", "full", "v", "v"), BV,
                    interpret)[0]
    do_BHNCV = chunks[9]
    ein = lambda spec, a, b: jnp.einsum(spec, a.astype(dt), b.astype(dt), preferred_element_type=f32,
                                        precision=_HI if dt == f32 else None)
    qa_BHNCK = (chunks[0] * p["alpha"]).astype(dt)
    Vc_BHNKV = scale * ein("...ck,...cv->...kv", qa_BHNCK, do_BHNCV) - ein(
        "...ck,...cv->...kv", p["W"], ein("...ic,...iv->...cv", p["Aqk"], do_BHNCV))
    G_BHNKV, dh0_BHKV = grid_call(
        functools.partial(_reverse_kernel, C=C),
        (ops["W"], ops["kw"], ops["lam"], pad_state(Vc_BHNKV, K, V), pad_state(dhT, K, V)),
        [vma.out_struct((B, H, N, K, V), f32, q), vma.out_struct((B, H, K, V), f32, q)],
        ("full", "full", "full", "v", "v", "v", "v"), BV, interpret)
    S_BHNKV, G_BHNKV = S_BHNKV[..., :K0, :V0], G_BHNKV[..., :K0, :V0]
    dots = _dots(dt)
    grads = chunked.vmap3(lambda *a: chunk.backward(*a[:9], a[10], a[11], a[9], scale, dots, pre=a[12]))
    dq, dk, dv, dg, dbeta, _ = grads(*chunks, S_BHNKV, G_BHNKV, p)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            dbeta.reshape(B, H, T), dh0_BHKV[:, :, :K0, :V0])
