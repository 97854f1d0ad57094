"""Pallas GPU (Triton) kernels for chunked simple GLA.

GPU programs run in parallel, so nothing is carried across grid steps: the grid is (B, H)
and each program loops over the N chunks of its sequence with a fori_loop carrying the
fp32 state (K x V) in registers.
  forward: o and the final state (forward sweep).
  dq:      forward sweep recomputing the states.
  dk, dv:  reverse sweep carrying G = dL/d(state), which ends as d(initial state).
Per-token factors (b, doc, alpha, w) are [B, H, T] fp32 vectors, see gla_chunked.
Triton needs power-of-two block shapes: K and V are zero-padded up to one (exact, the
padding adds zero terms) and the chunk size must be a power of two >= 16.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_HI = jax.lax.Precision.HIGHEST


def _dot(a, b, ta=False, tb=False):
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = _HI if jnp.float32 in (a.dtype, b.dtype) else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _f32(x):
    return x.astype(jnp.float32)


def _load(refs, n, C, scale):
    """Chunk n of q, k, v(, do) and its factors: scaled masked decay D [C, C], alpha, w [C, 1], lam."""
    s = pl.ds(pl.multiple_of(n * C, C), C)
    b_ref, doc_ref, alpha_ref, w_ref = refs[-4:]
    xs = [r[s, :] for r in refs[:-4]]
    b, doc, alpha, w = b_ref[s], doc_ref[s], alpha_ref[s], w_ref[s]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    mask = (i >= j) & (doc[:, None] == doc[None, :])
    D = jnp.exp(jnp.where(mask, b[:, None] - b[None, :], -jnp.inf)) * scale
    lam = jnp.sum(jnp.where(jnp.arange(C) == C - 1, alpha, 0.0))
    return s, xs, D, alpha[:, None], w[:, None], lam


def _fwd_kernel(q_ref, k_ref, v_ref, b_ref, doc_ref, alpha_ref, w_ref, h0_ref, o_ref, hT_ref, *, scale, C):
    def body(n, S):
        s, (q, k, v), D, alpha, w, lam = _load((q_ref, k_ref, v_ref, b_ref, doc_ref, alpha_ref, w_ref), n, C, scale)
        o = _dot(_dot(q, k, tb=True) * D, _f32(v)) + (scale * alpha) * _dot(_f32(q), S)
        o_ref[s, :] = o.astype(o_ref.dtype)
        return lam * S + _dot(_f32(k) * w, _f32(v), ta=True)

    hT_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // C, body, h0_ref[...])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref, h0_ref, dq_ref, *, scale, C):
    def body(n, S):
        s, (k, v, do), D, alpha, w, lam = _load((k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref), n, C,
                                                scale)
        dA = _dot(do, v, tb=True) * D
        dq_ref[s, :] = _dot(dA, _f32(k)) + (scale * alpha) * _dot(_f32(do), S, tb=True)
        return lam * S + _dot(_f32(k) * w, _f32(v), ta=True)

    jax.lax.fori_loop(0, q_ref.shape[0] // C, body, h0_ref[...])


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref, dhT_ref, dk_ref, dv_ref, dh0_ref,
                 *, scale, C):
    N = q_ref.shape[0] // C

    def body(r, G):
        refs = (q_ref, k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref)
        s, (q, k, v, do), D, alpha, w, lam = _load(refs, N - 1 - r, C, scale)
        A = _dot(q, k, tb=True) * D
        dA = _dot(do, v, tb=True) * D
        dk_ref[s, :] = _dot(dA, _f32(q), ta=True) + w * _dot(_f32(v), G, tb=True)
        dv_ref[s, :] = _dot(A, _f32(do), ta=True) + w * _dot(_f32(k), G)
        return lam * G + _dot(_f32(q) * (scale * alpha), _f32(do), ta=True)

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])


def _pow2(n):
    return max(16, 1 << (n - 1).bit_length())


def _pad_last(x, d):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def _pad_state(x, K, V):
    return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, K - x.shape[2]), (0, V - x.shape[3])))


def _call(kernel, args, outs, interpret, num_warps=4):
    B, H = args[0].shape[:2]

    def spec(x):
        return pl.BlockSpec((None, None) + x.shape[2:], lambda b, h: (b, h) + (0,) * (x.ndim - 2))

    return pl.pallas_call(
        kernel, grid=(B, H), in_specs=[spec(a) for a in args], out_specs=[spec(o) for o in outs],
        out_shape=outs, interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    )(*args)


def _check(C):
    if C < 16 or C & (C - 1):
        raise ValueError(f"pallas_gpu: chunk_size={C} must be a power of two >= 16 (Triton block shapes)")


def forward(q, k, v, aux, h0, scale, C, *, interpret=False):
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    K, V = _pow2(K0), _pow2(V0)
    aux4 = (aux["b"], aux["doc"].astype(jnp.float32), aux["alpha"], aux["w"])
    args = (_pad_last(q, K), _pad_last(k, K), _pad_last(v, V)) + aux4 + (_pad_state(h0, K, V),)
    outs = [jax.ShapeDtypeStruct((B, H, T, V), q.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
    o, hT = _call(functools.partial(_fwd_kernel, scale=scale, C=C), args, outs, interpret)
    return o[..., :V0], hT[:, :, :K0, :V0]


def backward(q, k, v, aux, h0, do, dhT, scale, C, *, interpret=False):
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    K, V = _pow2(K0), _pow2(V0)
    f32 = jnp.float32
    aux4 = (aux["b"], aux["doc"].astype(f32), aux["alpha"], aux["w"])
    qkvdo = (_pad_last(q, K), _pad_last(k, K), _pad_last(v, V), _pad_last(do, V))
    (dq,) = _call(functools.partial(_dq_kernel, scale=scale, C=C), qkvdo + aux4 + (_pad_state(h0, K, V),),
                  [jax.ShapeDtypeStruct((B, H, T, K), f32)], interpret)
    dk, dv, dh0 = _call(
        functools.partial(_dkdv_kernel, scale=scale, C=C), qkvdo + aux4 + (_pad_state(dhT, K, V),),
        [jax.ShapeDtypeStruct((B, H, T, K), f32), jax.ShapeDtypeStruct((B, H, T, V), f32),
         jax.ShapeDtypeStruct((B, H, K, V), f32)], interpret)
    return dq[..., :K0], dk[..., :K0], dv[..., :V0], dh0[:, :, :K0, :V0]
