"""Pallas TPU (Mosaic) kernels for chunked KDA.

Grid (B, H, N): one chunk of C tokens per step, the chunk axis last and "arbitrary", so the fp32
state (K x V) lives in a VMEM scratch and is carried from chunk to chunk. Per-chunk math in
chunk_math.
  forward: o and the final state, sweeping chunks forward.
  states:  the backward's forward sweep: the state entering every chunk [B, H, N, K, V]
           (recomputed, nothing is kept from the forward).
  backward: reverse sweep (index maps read chunk N-1-n) carrying G = dL/d(state); recomputes the
           chunk's intra quantities and writes dq, dk, dv, dg, dbeta and d(initial state).
Per-token scalars come as columns [.., T, 1] (beta, doc, first, last) and the document index
also as rows [B, 1, N, 1, C], so the kernels need no lane slicing or transposes of vectors.
Kernel refs hold one chunk of one head: q, k, g and their gradients [C, K]; v, do, o, dv [C, V];
b (beta), dc (doc), f (first), l (last), db [C, 1]; dr (doc row) [1, C]; the states [K, V].
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, K key dim, V value dim.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ling2.kernels.kda import chunk_math as chunk
from ling2.kernels import vma


def _load(refs):
    return [r[...] for r in refs]


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, dc_ref, dr_ref, f_ref, l_ref, h0_ref, o_ref, hT_ref, S_ref,
                *, scale, dt):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        S_ref[...] = h0_ref[...]

    o_CV, S_KV = chunk.forward(*_load((q_ref, k_ref, v_ref, g_ref, b_ref, dc_ref, dr_ref, f_ref, l_ref, S_ref)),
                               scale, chunk.Dots(dt))
    o_ref[...] = o_CV.astype(o_ref.dtype)
    S_ref[...] = S_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        hT_ref[...] = S_KV


def _states_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, dc_ref, dr_ref, f_ref, l_ref, h0_ref, Sin_ref, S_ref, *, scale,
                   dt):
    @pl.when(pl.program_id(2) == 0)
    def _():
        S_ref[...] = h0_ref[...]

    S_KV = S_ref[...]
    Sin_ref[...] = S_KV
    _, S_ref[...] = chunk.forward(*_load((q_ref, k_ref, v_ref, g_ref, b_ref, dc_ref, dr_ref, f_ref, l_ref)), S_KV,
                                  scale, chunk.Dots(dt))


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, dc_ref, dr_ref, f_ref, l_ref, Sin_ref, do_ref, dhT_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref, G_ref, *, scale, dt):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        G_ref[...] = dhT_ref[...]

    ins = _load((q_ref, k_ref, v_ref, g_ref, b_ref, dc_ref, dr_ref, f_ref, l_ref, Sin_ref))
    dq_CK, dk_CK, dv_CV, dg_CK, dbeta_C1, G_KV = chunk.backward(*ins, G_ref[...], do_ref[...], scale, chunk.Dots(dt))
    dq_ref[...], dk_ref[...], dv_ref[...], dg_ref[...], db_ref[...] = dq_CK, dk_CK, dv_CV, dg_CK, dbeta_C1
    G_ref[...] = G_KV

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = G_KV


def _aux_args(beta_BHT, aux, C):
    """beta [B, H, T, 1]; doc, first, last columns [B, 1, T, 1]; doc rows [B, 1, N, 1, C]; all fp32."""
    B, _, T = aux["doc"].shape
    f32 = jnp.float32
    col = lambda x: x.astype(f32)[..., None]
    return (col(beta_BHT), col(aux["doc"]), aux["doc"].astype(f32).reshape(B, 1, T // C, 1, C), col(aux["first"]),
            col(aux["last"]))


def _specs(C, K, V, N, reverse=False):
    """Block specs of (q, k, v, g, beta, doc col, doc row, first, last), a per-chunk state and a whole state."""
    fix = (lambda n: N - 1 - n) if reverse else (lambda n: n)
    tok = lambda d: pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, fix(n), 0))
    doc_col = pl.BlockSpec((None, None, C, 1), lambda b, h, n: (b, 0, fix(n), 0))
    doc_row = pl.BlockSpec((None, None, None, 1, C), lambda b, h, n: (b, 0, fix(n), 0, 0))
    ins = [tok(K), tok(K), tok(V), tok(K), tok(1), doc_col, doc_row, doc_col, doc_col]
    per_chunk = pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, fix(n), 0, 0))
    state = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, 0, 0))
    return tok, ins, per_chunk, state


def _call(kernel, name, args, in_specs, out_specs, out_shape, grid, K, V, interpret):
    return pl.pallas_call(
        kernel,
        name=name,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(*args)


def forward(q, k, v, g, beta, aux, h0, scale, C, *, interpret=False):
    B, H, T, K = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    tok, ins, _, state = _specs(C, K, V, T // C)
    o_BHTV, hT_BHKV = _call(
        functools.partial(_fwd_kernel, scale=scale, dt=q.dtype), "ling2_kda_fwd",
        (q, k, v, g.astype(f32), *_aux_args(beta, aux, C), h0.astype(f32)),
        ins + [state], [tok(V), state],
        [vma.out_struct((B, H, T, V), q.dtype, q), vma.out_struct((B, H, K, V), f32, q)],
        (B, H, T // C), K, V, interpret)
    return o_BHTV, hT_BHKV.astype(h0.dtype)


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C, *, interpret=False):
    B, H, T, K = q.shape
    V, N = v.shape[-1], T // C
    f32 = jnp.float32
    args = (q, k, v, g.astype(f32), *_aux_args(beta, aux, C))
    _, ins, per_chunk, state = _specs(C, K, V, N)
    S_BHNKV = _call(functools.partial(_states_kernel, scale=scale, dt=q.dtype), "ling2_kda_states",
                    args + (h0.astype(f32),),
                    ins + [state], per_chunk, vma.out_struct((B, H, N, K, V), f32, q), (B, H, N), K, V, interpret)
    tok, ins, per_chunk, state = _specs(C, K, V, N, reverse=True)
    dq_BHTK, dk_BHTK, dv_BHTV, dg_BHTK, dbeta_BHT1, dh0_BHKV = _call(
        functools.partial(_bwd_kernel, scale=scale, dt=q.dtype), "ling2_kda_bwd",
        args + (S_BHNKV, do, dhT.astype(f32)),
        ins + [per_chunk, tok(V), state],
        [tok(K), tok(K), tok(V), tok(K), tok(1), state],
        [vma.out_struct((B, H, T, K), f32, q), vma.out_struct((B, H, T, K), f32, q),
         vma.out_struct((B, H, T, V), f32, q), vma.out_struct((B, H, T, K), f32, q),
         vma.out_struct((B, H, T, 1), f32, q), vma.out_struct((B, H, K, V), f32, q)],
        (B, H, N), K, V, interpret)
    return dq_BHTK, dk_BHTK, dv_BHTV, dg_BHTK, dbeta_BHT1[..., 0], dh0_BHKV
