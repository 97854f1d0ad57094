"""Pallas TPU (Mosaic) kernels for chunked simple GLA.

Grid (B, H, N): one chunk of C tokens per step, the chunk axis last and "arbitrary", so
the fp32 state (K x V) lives in a VMEM scratch and is carried from chunk to chunk.
  forward: o and the final state, sweeping chunks forward.
  dq:      forward sweep again (recomputing the states), nothing stored from the forward.
  dk, dv:  reverse sweep (index maps read chunk N-1-n), carrying G = dL/d(state).
Per-token factors come in two layouts so no in-kernel transpose is needed:
  col [B, H, T, 4] (b, doc, alpha, w as columns) and row [B, H, N, 4, C].
Math as in gla_chunked; D_ij = e^{b_i - b_j} masked (before exp) to j <= i, same document.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_HI = jax.lax.Precision.HIGHEST


def _dot(a, b, ta=False, tb=False):
    """a @ b with optional transposes, fp32 accumulation."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = _HI if jnp.float32 in (a.dtype, b.dtype) else None
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def _factors(col_ref, row_ref, scale):
    """Per-chunk factors: scaled masked decay D [C, C], alpha and w columns [C, 1], lam [1, 1]."""
    col, row = col_ref[...], row_ref[...]
    C = col.shape[0]
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    mask = (i >= j) & (col[:, 1:2] == row[1:2, :])
    D = jnp.exp(jnp.where(mask, col[:, 0:1] - row[0:1, :], -jnp.inf)) * scale
    return D, col[:, 2:3], col[:, 3:4], col[C - 1:C, 2:3]


def _f32(x):
    return x.astype(jnp.float32)


def _fwd_kernel(q_ref, k_ref, v_ref, col_ref, row_ref, h0_ref, o_ref, hT_ref, S_ref, *, scale):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = h0_ref[...]

    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    D, alpha, w, lam = _factors(col_ref, row_ref, scale)
    S = S_ref[...]
    A = _dot(q, k, tb=True) * D
    o = _dot(A, _f32(v)) + (scale * alpha) * _dot(_f32(q), S)
    o_ref[...] = o.astype(o_ref.dtype)
    S = lam * S + _dot(_f32(k) * w, _f32(v), ta=True)
    S_ref[...] = S

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = S


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, col_ref, row_ref, h0_ref, dq_ref, S_ref, *, scale):
    @pl.when(pl.program_id(2) == 0)
    def _():
        S_ref[...] = h0_ref[...]

    k, v, do = k_ref[...], v_ref[...], do_ref[...]
    D, alpha, w, lam = _factors(col_ref, row_ref, scale)
    S = S_ref[...]
    dA = _dot(do, v, tb=True) * D
    dq_ref[...] = _dot(dA, _f32(k)) + (scale * alpha) * _dot(_f32(do), S, tb=True)
    S_ref[...] = lam * S + _dot(_f32(k) * w, _f32(v), ta=True)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, col_ref, row_ref, dhT_ref, dk_ref, dv_ref, dh0_ref, G_ref,
                 *, scale):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        G_ref[...] = dhT_ref[...]

    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    D, alpha, w, lam = _factors(col_ref, row_ref, scale)
    G = G_ref[...]
    A = _dot(q, k, tb=True) * D
    dA = _dot(do, v, tb=True) * D
    dk_ref[...] = _dot(dA, _f32(q), ta=True) + w * _dot(_f32(v), G, tb=True)
    dv_ref[...] = _dot(A, _f32(do), ta=True) + w * _dot(_f32(k), G)
    G = lam * G + _dot(_f32(q) * (scale * alpha), _f32(do), ta=True)
    G_ref[...] = G

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = G


def _layouts(aux, C):
    B, H, T = aux["b"].shape
    cols = jnp.stack([aux["b"], aux["doc"].astype(jnp.float32), aux["alpha"], aux["w"]], axis=-1)
    rows = cols.reshape(B, H, T // C, C, 4).swapaxes(-1, -2)
    return cols, rows


def _specs(C, K, V, N, reverse=False):
    """Block specs: per-chunk token blocks (read backwards for the reverse sweep), rows, state."""
    fix = (lambda n: N - 1 - n) if reverse else (lambda n: n)

    def tok(d):
        return pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, fix(n), 0))

    row = pl.BlockSpec((None, None, None, 4, C), lambda b, h, n: (b, h, fix(n), 0, 0))
    state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
    return tok, row, state


def _call(kernel, args, in_specs, out_specs, out_shape, grid, K, V, interpret):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(*args)


def forward(q, k, v, aux, h0, scale, C, *, interpret=False):
    B, H, T, K = q.shape
    V = v.shape[-1]
    tok, row, state = _specs(C, K, V, T // C)
    cols, rows = _layouts(aux, C)
    return _call(
        functools.partial(_fwd_kernel, scale=scale),
        (q, k, v, cols, rows, h0.astype(jnp.float32)),
        [tok(K), tok(K), tok(V), tok(4), row, state],
        [tok(V), state],
        [jax.ShapeDtypeStruct((B, H, T, V), q.dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)],
        (B, H, T // C), K, V, interpret)


def backward(q, k, v, aux, h0, do, dhT, scale, C, *, interpret=False):
    B, H, T, K = q.shape
    V = v.shape[-1]
    cols, rows = _layouts(aux, C)
    f32 = jnp.float32
    tok, row, state = _specs(C, K, V, T // C)
    dq = _call(
        functools.partial(_dq_kernel, scale=scale),
        (q, k, v, do, cols, rows, h0.astype(f32)),
        [tok(K), tok(K), tok(V), tok(V), tok(4), row, state],
        tok(K), jax.ShapeDtypeStruct((B, H, T, K), f32),
        (B, H, T // C), K, V, interpret)
    tok, row, state = _specs(C, K, V, T // C, reverse=True)
    dk, dv, dh0 = _call(
        functools.partial(_dkdv_kernel, scale=scale),
        (q, k, v, do, cols, rows, dhT.astype(f32)),
        [tok(K), tok(K), tok(V), tok(V), tok(4), row, state],
        [tok(K), tok(V), state],
        [jax.ShapeDtypeStruct((B, H, T, K), f32), jax.ShapeDtypeStruct((B, H, T, V), f32),
         jax.ShapeDtypeStruct((B, H, K, V), f32)],
        (B, H, T // C), K, V, interpret)
    return dq, dk, dv, dh0
