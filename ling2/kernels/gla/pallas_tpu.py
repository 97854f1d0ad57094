"""Pallas TPU (Mosaic) kernels for chunked simple GLA.

Grid (B, H, N): one chunk of C tokens per step, the chunk axis last and "arbitrary", so
the fp32 state (K x V) lives in a VMEM scratch and is carried from chunk to chunk.
  forward: o and the final state, sweeping chunks forward.
  dq:      forward sweep again (recomputing the states), nothing stored from the forward.
  dk, dv:  reverse sweep (index maps read chunk N-1-n), carrying G = dL/d(state).
The per-token fp32 factors (b, doc, alpha, w) of a chunk come as one lane-dense tile: rows of
[B, H, N, 8, C] (4 zero rows pad it to the 8 sublanes of a vreg). The kernel transposes the
tile for the column views it needs. (A [B, H, T, 1] column would be padded to 128 lanes in
HBM: 128x the bytes of the factor and of its reads.)
Math as in chunked.py; D_ij = e^{b_i - b_j} masked (before exp) to j <= i, same document.
Kernel refs hold one chunk of one head: q, k, dq, dk [C, K]; v, do, o, dv [C, V]; fac [8, C];
the states h0, hT, S, G and their gradients [K, V].
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, K key dim, V value dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ling2.kernels import vma

_HI = jax.lax.Precision.HIGHEST


def _dot(a, b, dt, ta=False, tb=False):
    """a @ b (optionally transposed) on operands cast to dt, fp32 accumulation; exact fp32 when dt is fp32.
    With bf16 inputs the fp32 state enters its matmuls as bf16 (as fla does); it accumulates in fp32."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = _HI if dt == jnp.float32 else None
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), dims, precision=prec, preferred_element_type=jnp.float32)


def _factors(fac_ref, scale):
    """Per-chunk factors from the [8, C] tile: scaled masked decay D [C, C], alpha and w columns
    [C, 1], lam [1, 1]."""
    rows_8C = fac_ref[...]
    cols_C8 = rows_8C.T
    b_C1, doc_C1, alpha_C1, w_C1 = (cols_C8[:, i:i + 1] for i in range(4))
    b_1C, doc_1C = rows_8C[0:1, :], rows_8C[1:2, :]
    C = rows_8C.shape[1]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    mask_CC = (i >= j) & (doc_C1 == doc_1C)
    D_CC = jnp.exp(jnp.where(mask_CC, b_C1 - b_1C, -jnp.inf)) * scale
    last_C1 = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    lam_11 = jnp.sum(jnp.where(last_C1, alpha_C1, 0.0), axis=0, keepdims=True)  # alpha of the last token
    return D_CC, alpha_C1, w_C1, lam_11


def _fwd_kernel(q_ref, k_ref, v_ref, fac_ref, h0_ref, o_ref, hT_ref, S_ref, *, scale):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = h0_ref[...]

    q_CK, k_CK, v_CV = q_ref[...], k_ref[...], v_ref[...]
    D_CC, alpha_C1, w_C1, lam_11 = _factors(fac_ref, scale)
    dt = q_ref.dtype
    S_KV = S_ref[...]
    A_CC = _dot(q_CK, k_CK, dt, tb=True) * D_CC
    o_CV = _dot(A_CC, v_CV, dt) + (scale * alpha_C1) * _dot(q_CK, S_KV, dt)
    o_ref[...] = o_CV.astype(o_ref.dtype)
    S_KV = lam_11 * S_KV + _dot(k_CK * w_C1, v_CV, dt, ta=True)
    S_ref[...] = S_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = S_KV


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, fac_ref, h0_ref, dq_ref, S_ref, *, scale):
    @pl.when(pl.program_id(2) == 0)
    def _():
        S_ref[...] = h0_ref[...]

    k_CK, v_CV, do_CV = k_ref[...], v_ref[...], do_ref[...]
    D_CC, alpha_C1, w_C1, lam_11 = _factors(fac_ref, scale)
    dt = q_ref.dtype
    S_KV = S_ref[...]
    dA_CC = _dot(do_CV, v_CV, dt, tb=True) * D_CC
    dq_ref[...] = _dot(dA_CC, k_CK, dt) + (scale * alpha_C1) * _dot(do_CV, S_KV, dt, tb=True)
    S_ref[...] = lam_11 * S_KV + _dot(k_CK * w_C1, v_CV, dt, ta=True)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, fac_ref, dhT_ref, dk_ref, dv_ref, dh0_ref, G_ref, *, scale):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        G_ref[...] = dhT_ref[...]

    q_CK, k_CK, v_CV, do_CV = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    D_CC, alpha_C1, w_C1, lam_11 = _factors(fac_ref, scale)
    dt = q_ref.dtype
    G_KV = G_ref[...]
    A_CC = _dot(q_CK, k_CK, dt, tb=True) * D_CC
    dA_CC = _dot(do_CV, v_CV, dt, tb=True) * D_CC
    dk_ref[...] = _dot(dA_CC, q_CK, dt, ta=True) + w_C1 * _dot(v_CV, G_KV, dt, tb=True)
    dv_ref[...] = _dot(A_CC, do_CV, dt, ta=True) + w_C1 * _dot(k_CK, G_KV, dt)
    G_KV = lam_11 * G_KV + _dot(q_CK * (scale * alpha_C1), do_CV, dt, ta=True)
    G_ref[...] = G_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = G_KV


def _factor_tiles(aux, C):
    """(b, doc, alpha, w) [B, H, T] -> one fp32 tile per chunk [B, H, N, 8, C], rows 4..7 zero."""
    B, H, T = aux["b"].shape
    rows_BHN1C = [aux[name].astype(jnp.float32).reshape(B, H, T // C, 1, C) for name in ("b", "doc", "alpha", "w")]
    return jnp.concatenate(rows_BHN1C + [jnp.zeros((B, H, T // C, 4, C), jnp.float32)], axis=3)


def _specs(C, K, V, N, reverse=False):
    """Block specs: per-chunk token blocks (read backwards for the reverse sweep), factor tile, state."""
    fix = (lambda n: N - 1 - n) if reverse else (lambda n: n)

    def tok(d):
        return pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, fix(n), 0))

    fac = pl.BlockSpec((None, None, None, 8, C), lambda b, h, n: (b, h, fix(n), 0, 0))
    state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
    return tok, fac, state


def _cost(matmul_flops_per_chunk, args, out_shape, B, H, N, C):
    """XLA's cost analysis counts a Mosaic call as free unless told: FLOPs of the chunk matmuls,
    one exp per decay entry, and every operand and result read or written once."""
    nbytes = lambda x: x.size * jnp.dtype(x.dtype).itemsize
    outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
    return pl.CostEstimate(flops=int(B * H * N * matmul_flops_per_chunk), transcendentals=int(B * H * N * C * C),
                           bytes_accessed=int(sum(nbytes(x) for x in list(args) + list(outs))))


def _call(kernel, name, flops_per_chunk, args, in_specs, out_specs, out_shape, grid, C, K, V, interpret):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=name,
        cost_estimate=_cost(flops_per_chunk, args, out_shape, *grid, C),
    )(*args)


def forward(q, k, v, aux, h0, scale, C, *, interpret=False):
    B, H, T, K = q.shape
    V = v.shape[-1]
    tok, fac_spec, state = _specs(C, K, V, T // C)
    fac_BHN8C = _factor_tiles(aux, C)
    return _call(
        functools.partial(_fwd_kernel, scale=scale), "ling2_gla_fwd", 2 * C * C * (K + V) + 4 * C * K * V,
        (q, k, v, fac_BHN8C, h0.astype(jnp.float32)),
        [tok(K), tok(K), tok(V), fac_spec, state],
        [tok(V), state],
        [vma.out_struct((B, H, T, V), q.dtype, q), vma.out_struct((B, H, K, V), jnp.float32, q)],
        (B, H, T // C), C, K, V, interpret)


def backward(q, k, v, aux, h0, do, dhT, scale, C, *, interpret=False):
    B, H, T, K = q.shape
    V = v.shape[-1]
    fac_BHN8C = _factor_tiles(aux, C)
    f32 = jnp.float32
    tok, fac_spec, state = _specs(C, K, V, T // C)
    dq_BHTK = _call(
        functools.partial(_dq_kernel, scale=scale), "ling2_gla_dq", 2 * C * C * (K + V) + 4 * C * K * V,
        (q, k, v, do, fac_BHN8C, h0.astype(f32)),
        [tok(K), tok(K), tok(V), tok(V), fac_spec, state],
        tok(K), vma.out_struct((B, H, T, K), f32, q),
        (B, H, T // C), C, K, V, interpret)
    tok, fac_spec, state = _specs(C, K, V, T // C, reverse=True)
    dk_BHTK, dv_BHTV, dh0_BHKV = _call(
        functools.partial(_dkdv_kernel, scale=scale), "ling2_gla_dkdv", 4 * C * C * (K + V) + 6 * C * K * V,
        (q, k, v, do, fac_BHN8C, dhT.astype(f32)),
        [tok(K), tok(K), tok(V), tok(V), fac_spec, state],
        [tok(K), tok(V), state],
        [vma.out_struct((B, H, T, K), f32, q), vma.out_struct((B, H, T, V), f32, q),
         vma.out_struct((B, H, K, V), f32, q)],
        (B, H, T // C), C, K, V, interpret)
    return dq_BHTK, dk_BHTK, dv_BHTV, dh0_BHKV
