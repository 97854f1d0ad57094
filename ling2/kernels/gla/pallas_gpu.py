"""Pallas GPU (Triton) kernels for chunked simple GLA.

GPU programs run in parallel, so nothing is carried across grid steps: the grid is
(B, H, V / BLOCK_V) and each program loops over the N chunks of its sequence with a
fori_loop carrying its fp32 slice of the state (K x BLOCK_V) in registers. Output columns
only need their own state columns; dq and dk sum over all of V, so each V block writes a
partial that is summed outside.
  forward: o and the final state (forward sweep).
  dq:      forward sweep recomputing the states.
  dk, dv:  reverse sweep carrying G = dL/d(state), which ends as d(initial state).
Per-token factors (b, doc, alpha, w) are [B, H, T] fp32 vectors, see chunked.py.
Triton needs power-of-two block shapes: K and V are zero-padded up to one (exact, the
padding adds zero terms) and the chunk size must be a power of two >= 16.
Kernel refs hold one head's whole sequence: q, k, dq, dk [T, K]; v, do, o, dv [T, BLOCK_V];
b, doc, alpha, w [T]; the states h0, hT and their gradients [K, BLOCK_V].
Axes in names: B batch, H heads, T time (padded), C chunk size, K key dim, V value dim (or a
block of it), P V blocks (per-block partial sums).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ling2.kernels import vma
from ling2.kernels.triton_blocks import dot, grid_call, pad_last, pad_state, pow2

BLOCK_V = 64  # state columns per program


def _load(refs, n, C, scale):
    """Chunk n of q, k, v(, do) and its factors: scaled masked decay D [C, C], alpha, w [C, 1], lam."""
    s = pl.ds(pl.multiple_of(n * C, C), C)
    b_ref, doc_ref, alpha_ref, w_ref = refs[-4:]
    xs = [r[s, :] for r in refs[:-4]]
    b_C, doc_C, alpha_C, w_C = b_ref[s], doc_ref[s], alpha_ref[s], w_ref[s]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    mask_CC = (i >= j) & (doc_C[:, None] == doc_C[None, :])
    D_CC = jnp.exp(jnp.where(mask_CC, b_C[:, None] - b_C[None, :], -jnp.inf)) * scale
    lam = jnp.sum(jnp.where(jnp.arange(C) == C - 1, alpha_C, 0.0))
    return s, xs, D_CC, alpha_C[:, None], w_C[:, None], lam


def _fwd_kernel(q_ref, k_ref, v_ref, b_ref, doc_ref, alpha_ref, w_ref, h0_ref, o_ref, hT_ref, *, scale, C):
    dt = q_ref.dtype

    def body(n, S_KV):
        refs = (q_ref, k_ref, v_ref, b_ref, doc_ref, alpha_ref, w_ref)
        s, (q_CK, k_CK, v_CV), D_CC, alpha_C1, w_C1, lam = _load(refs, n, C, scale)
        o_CV = dot(dot(q_CK, k_CK, dt, tb=True) * D_CC, v_CV, dt) + (scale * alpha_C1) * dot(q_CK, S_KV, dt)
        o_ref[s, :] = o_CV.astype(o_ref.dtype)
        return lam * S_KV + dot(k_CK * w_C1, v_CV, dt, ta=True)

    hT_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // C, body, h0_ref[...])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref, h0_ref, dq_ref, *, scale, C):
    dt = q_ref.dtype

    def body(n, S_KV):
        refs = (k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref)
        s, (k_CK, v_CV, do_CV), D_CC, alpha_C1, w_C1, lam = _load(refs, n, C, scale)
        dA_CC = dot(do_CV, v_CV, dt, tb=True) * D_CC
        dq_ref[s, :] = dot(dA_CC, k_CK, dt) + (scale * alpha_C1) * dot(do_CV, S_KV, dt, tb=True)
        return lam * S_KV + dot(k_CK * w_C1, v_CV, dt, ta=True)

    jax.lax.fori_loop(0, q_ref.shape[0] // C, body, h0_ref[...])


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref, dhT_ref, dk_ref, dv_ref, dh0_ref,
                 *, scale, C):
    N, dt = q_ref.shape[0] // C, q_ref.dtype

    def body(r, G_KV):
        refs = (q_ref, k_ref, v_ref, do_ref, b_ref, doc_ref, alpha_ref, w_ref)
        s, (q_CK, k_CK, v_CV, do_CV), D_CC, alpha_C1, w_C1, lam = _load(refs, N - 1 - r, C, scale)
        A_CC = dot(q_CK, k_CK, dt, tb=True) * D_CC
        dA_CC = dot(do_CV, v_CV, dt, tb=True) * D_CC
        dk_ref[s, :] = dot(dA_CC, q_CK, dt, ta=True) + w_C1 * dot(v_CV, G_KV, dt, tb=True)
        dv_ref[s, :] = dot(A_CC, do_CV, dt, ta=True) + w_C1 * dot(k_CK, G_KV, dt)
        return lam * G_KV + dot(q_CK * (scale * alpha_C1), do_CV, dt, ta=True)

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])



def supports_chunk(C):
    """Triton block shapes: the chunk must be a power of two >= 16."""
    return C >= 16 and C & (C - 1) == 0


def _check(C):
    if not supports_chunk(C):
        raise ValueError(f"pallas_gpu: chunk_size={C} must be a power of two >= 16 (Triton block shapes)")


def forward(q, k, v, aux, h0, scale, C, *, interpret=False, block_v=None):
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    K, V = pow2(K0), pow2(V0)
    BV = min(V, block_v or BLOCK_V)
    aux4 = (aux["b"], aux["doc"].astype(jnp.float32), aux["alpha"], aux["w"])
    args = (pad_last(q, K), pad_last(k, K), pad_last(v, V)) + aux4 + (pad_state(h0, K, V),)
    outs = [vma.out_struct((B, H, T, V), q.dtype, q), vma.out_struct((B, H, K, V), jnp.float32, q)]
    kinds = ("full", "full", "v") + ("full",) * 4 + ("v", "v", "v")
    o_BHTV, hT_BHKV = grid_call(functools.partial(_fwd_kernel, scale=scale, C=C), args, outs, kinds, BV, interpret)
    return o_BHTV[..., :V0], hT_BHKV[:, :, :K0, :V0]


def backward(q, k, v, aux, h0, do, dhT, scale, C, *, interpret=False, block_v=None):
    """dq and dk are sums over V blocks of per-block partials (each block sees its slice of S, G)."""
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    K, V = pow2(K0), pow2(V0)
    BV = min(V, block_v or BLOCK_V)
    NV = V // BV
    f32 = jnp.float32
    aux4 = (aux["b"], aux["doc"].astype(f32), aux["alpha"], aux["w"])
    qkvdo = (pad_last(q, K), pad_last(k, K), pad_last(v, V), pad_last(do, V))
    kinds_in = ("full", "full", "v", "v") + ("full",) * 4 + ("v",)
    part = vma.out_struct((NV, B, H, T, K), f32, q)
    (dq_PBHTK,) = grid_call(functools.partial(_dq_kernel, scale=scale, C=C), qkvdo + aux4 + (pad_state(h0, K, V),),
                        [part], kinds_in + ("part",), BV, interpret)
    dk_PBHTK, dv_BHTV, dh0_BHKV = grid_call(
        functools.partial(_dkdv_kernel, scale=scale, C=C), qkvdo + aux4 + (pad_state(dhT, K, V),),
        [part, vma.out_struct((B, H, T, V), f32, q), vma.out_struct((B, H, K, V), f32, q)],
        kinds_in + ("part", "v", "v"), BV, interpret)
    dq_BHTK, dk_BHTK = dq_PBHTK.sum(0), dk_PBHTK.sum(0)
    return dq_BHTK[..., :K0], dk_BHTK[..., :K0], dv_BHTV[..., :V0], dh0_BHKV[:, :, :K0, :V0]
