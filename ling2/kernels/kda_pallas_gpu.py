"""Pallas GPU (Triton) kernels for chunked KDA.

GPU programs run in parallel, so nothing is carried across grid steps: the grid is
(B, H, V / BLOCK_V) and each program loops over the N chunks of its sequence with a fori_loop
carrying its fp32 slice of the state (K x BLOCK_V). Output columns only need their own state
columns; the intra-chunk quantities (Aqk, Akk, T = (I + Akk)^-1) do not depend on V and are
recomputed by every V block. Per-chunk math in kda_chunk_math.
  forward: o and the final state (forward sweep).
  states:  the backward's forward sweep, writing the state entering every chunk [B, H, N, K, V].
  backward: reverse sweep carrying G = dL/d(state); dq, dk, dg and dbeta sum over all of V, so each
           V block writes a partial that is summed outside.
Per-token scalars (beta, doc, first, last) are [.., T] fp32 vectors. Triton needs power-of-two
block shapes: K and V are zero-padded up to one (exact: padded key dims have k = 0, g = 0) and
the chunk size is a power of two >= 16.
Kernel refs hold one head's whole sequence: q, k, g and their gradients [T, K]; v, do, o, dv
[T, BLOCK_V]; b (beta), doc, f (first), l (last), db [T]; the states [K, BLOCK_V] (Sin: [N, K, BLOCK_V]).
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, K key dim, V value dim
(or a block of it), P V blocks (per-block partial sums).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling2.kernels import kda_chunk_math as chunk
from ling2.kernels.gpu_padding import pad_last, pad_state, pow2

BLOCK_V = 64  # state columns per program


def _dots(dt):
    return chunk.Dots(dt, mid_low=jax.lax.Precision.HIGH)  # TF32 for the decay products and the inverse


def _load(refs, n, C):
    """Chunk n of the [T, D] refs and of the [T] vectors (as columns, plus the document row)."""
    s = pl.ds(pl.multiple_of(n * C, C), C)
    mats, (b_ref, doc_ref, f_ref, l_ref) = refs[:-4], refs[-4:]
    doc_C = doc_ref[s]
    cols = (b_ref[s][:, None], doc_C[:, None], doc_C[None, :], f_ref[s][:, None], l_ref[s][:, None])
    return s, [r[s, :] for r in mats], cols


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, f_ref, l_ref, h0_ref, o_ref, hT_ref, *, scale, C, dt):
    def body(n, S_KV):
        s, (q_CK, k_CK, v_CV, g_CK), cols = _load((q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, f_ref, l_ref), n, C)
        o_CV, S_KV = chunk.forward(q_CK, k_CK, v_CV, g_CK, *cols, S_KV, scale, _dots(dt))
        o_ref[s, :] = o_CV.astype(o_ref.dtype)
        return S_KV

    hT_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // C, body, h0_ref[...])


def _states_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, f_ref, l_ref, h0_ref, Sin_ref, *, scale, C, dt):
    def body(n, S_KV):
        _, (q_CK, k_CK, v_CV, g_CK), cols = _load((q_ref, k_ref, v_ref, g_ref, b_ref, doc_ref, f_ref, l_ref), n, C)
        Sin_ref[n] = S_KV
        return chunk.forward(q_CK, k_CK, v_CV, g_CK, *cols, S_KV, scale, _dots(dt))[1]

    jax.lax.fori_loop(0, q_ref.shape[0] // C, body, h0_ref[...])


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, b_ref, doc_ref, f_ref, l_ref, Sin_ref, dhT_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, *, scale, C, dt):
    N = q_ref.shape[0] // C

    def body(r, G_KV):
        n = N - 1 - r
        refs = (q_ref, k_ref, v_ref, g_ref, do_ref, b_ref, doc_ref, f_ref, l_ref)
        s, (q_CK, k_CK, v_CV, g_CK, do_CV), cols = _load(refs, n, C)
        dq_CK, dk_CK, dv_CV, dg_CK, dbeta_C1, G_KV = chunk.backward(q_CK, k_CK, v_CV, g_CK, *cols, Sin_ref[n], G_KV,
                                                                    do_CV, scale, _dots(dt))
        dq_ref[s, :], dk_ref[s, :], dv_ref[s, :], dg_ref[s, :] = dq_CK, dk_CK, dv_CV, dg_CK
        db_ref[s] = dbeta_C1[:, 0]
        return G_KV

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])



def _call(kernel, args, outs, kinds, BV, interpret, num_warps=4):
    """Grid (B, H, V / BV). kinds[i] for each arg then output: "full" (whole per-head array), "doc" (a [B, T]
    array shared by the heads), "v" (last dim split into V blocks of BV) or "part" (per-V-block partial sums,
    leading axis)."""
    B, H = args[0].shape[:2]
    NV = args[2].shape[-1] // BV

    def spec(x, kind):
        if kind == "part":
            return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, j: (j, b, h) + (0,) * (x.ndim - 3))
        if kind == "doc":
            return pl.BlockSpec((None, x.shape[1]), lambda b, h, j: (b, 0))
        if kind == "v":
            return pl.BlockSpec((None, None) + x.shape[2:-1] + (BV,),
                                lambda b, h, j: (b, h) + (0,) * (x.ndim - 3) + (j,))
        return pl.BlockSpec((None, None) + x.shape[2:], lambda b, h, j: (b, h) + (0,) * (x.ndim - 2))

    return pl.pallas_call(
        kernel, grid=(B, H, NV), in_specs=[spec(a, kd) for a, kd in zip(args, kinds)],
        out_specs=[spec(o, kd) for o, kd in zip(outs, kinds[len(args):])], out_shape=outs, interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    )(*args)


def _check(C):
    if C < 16 or C & (C - 1):
        raise ValueError(f"pallas_gpu: chunk_size={C} must be a power of two >= 16 (Triton block shapes)")


def _common(q, k, v, g, beta, aux, block_v):
    B, H, T, K0 = q.shape
    K, V = pow2(K0), pow2(v.shape[-1])
    BV = min(V, block_v or BLOCK_V)
    f32 = jnp.float32
    vec = lambda x: x.astype(f32)[:, 0]  # [B, 1, T] -> [B, T]
    qkvg = (pad_last(q, K), pad_last(k, K), pad_last(v, V), pad_last(g.astype(f32), K))
    return qkvg, (beta.astype(f32),), (vec(aux["doc"]), vec(aux["first"]), vec(aux["last"])), K, V, BV


def forward(q, k, v, g, beta, aux, h0, scale, C, *, interpret=False, block_v=None):
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    qkvg, bt, docs, K, V, BV = _common(q, k, v, g, beta, aux, block_v)
    outs = [jax.ShapeDtypeStruct((B, H, T, V), q.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
    kinds = ("full", "full", "v", "full", "full", "doc", "doc", "doc", "v", "v", "v")
    o_BHTV, hT_BHKV = _call(functools.partial(_fwd_kernel, scale=scale, C=C, dt=q.dtype),
                            qkvg + bt + docs + (pad_state(h0, K, V),), outs, kinds, BV, interpret)
    return o_BHTV[..., :V0], hT_BHKV[:, :, :K0, :V0].astype(h0.dtype)


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C, *, interpret=False, block_v=None):
    """dq, dk, dg and dbeta are sums over V blocks of per-block partials (each block sees its slice of S, G)."""
    _check(C)
    B, H, T, K0 = q.shape
    V0, N = v.shape[-1], T // C
    f32 = jnp.float32
    qkvg, bt, docs, K, V, BV = _common(q, k, v, g, beta, aux, block_v)
    NV = V // BV
    S_BHNKV = _call(functools.partial(_states_kernel, scale=scale, C=C, dt=q.dtype),
                    qkvg + bt + docs + (pad_state(h0, K, V),), [jax.ShapeDtypeStruct((B, H, N, K, V), f32)],
                    ("full", "full", "v", "full", "full", "doc", "doc", "doc", "v", "v"), BV, interpret)[0]
    part = lambda *shape: jax.ShapeDtypeStruct((NV, B, H) + shape, f32)
    dq_PBHTK, dk_PBHTK, dv_BHTV, dg_PBHTK, dbeta_PBHT, dh0_BHKV = _call(
        functools.partial(_bwd_kernel, scale=scale, C=C, dt=q.dtype),
        qkvg + (pad_last(do, V),) + bt + docs + (S_BHNKV, pad_state(dhT, K, V)),
        [part(T, K), part(T, K), jax.ShapeDtypeStruct((B, H, T, V), f32), part(T, K), part(T),
         jax.ShapeDtypeStruct((B, H, K, V), f32)],
        ("full", "full", "v", "full", "v", "full", "doc", "doc", "doc", "v", "v",
         "part", "part", "v", "part", "part", "v"), BV, interpret)
    dq_BHTK, dk_BHTK, dg_BHTK, dbeta_BHT = (x.sum(0) for x in (dq_PBHTK, dk_PBHTK, dg_PBHTK, dbeta_PBHT))
    return (dq_BHTK[..., :K0], dk_BHTK[..., :K0], dv_BHTV[..., :V0], dg_BHTK[..., :K0], dbeta_BHT,
            dh0_BHKV[:, :, :K0, :V0])
