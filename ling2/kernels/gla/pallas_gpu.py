"""Pallas GPU (Triton) kernels for chunked simple GLA.

GPU programs run in parallel, so the only sequential work is the chunk-to-chunk state recurrence:
short sweeps carry the state with one matmul per chunk and store it at every chunk edge, then
kernels over all chunks at once compute everything else from those stored states.
Sweeps, grid (V / BV, K / BK, B, H) for a [BK, BV] = [SWEEP_BLOCK_K, SWEEP_BLOCK_V] block of the state:
each program walks the N chunks of one head in order, carrying its fp32 block. The sweeps are sequential
and latency-bound, so smaller blocks (more programs in flight per SM) can pay where the chunk kernels, which
read q and k once per block, want wide ones: the two are set apart. SWEEP_STAGES = 3 keeps the loads of chunk n + 2 in
flight while chunk n computes; with 2, Triton issues chunk n + 1's loads after chunk n's matmul and waits
for all of them at the top of chunk n + 1 (`cp.async.wait_group 0` in the PTX), so they overlap nothing:
  states:  h_n, the state entering chunk n, then h_{n+1} = lam_n h_n + k^T (w v); ends as the final state.
  dstates: dh_n = dL/d(state leaving chunk n), then dh_{n-1} = lam_n dh_n + q^T (scale alpha do); ends as
           d(initial state).
The per-token factor scales the matmul's untransposed operand (v, do), so the transposed one (k, q) enters
the matmul as loaded, with no elementwise pass and register transpose on the sequential path (fla's
chunk_fwd_h scales v the same way).
Chunk kernels, grid (blocks, N, B, H), one chunk and one block of V (or K) per program:
  out:   o = (q k^T * D) v + scale alpha q h_n                      a V block, summing over K blocks
  dv:    dv = (k q^T * D^T) do + w k dh_n                           a V block, summing over K blocks
  dqdk:  dA = (do v^T) * D;  dq = dA k + scale alpha do h_n^T;  dk = dA^T q + w v dh_n^T
                                                                    a K block, summing over V blocks
D_ij = scale e^{b_i - b_j} for j <= i in the same document (masked before exp); lam_n = alpha of chunk
n's last token (0 when a document starts inside it). The forward runs states then out; the backward
recomputes the states, then dstates, dv and dqdk. Per-token factors (b, doc, alpha, w) are [B, H, T]
fp32 vectors, see chunked.py.
The stored states h_n, dh_n are [B, H, N, K, V] in STATE_DTYPE, by default the inputs' dtype. With bf16
inputs every matmul takes them as bf16 (fla's convention), so storing them as bf16 gives the same numbers
as fp32 storage at half the traffic: the chunk kernels are HBM-bound (tools/bench/gla/NOTES.md).
Triton needs power-of-two block shapes: K and V are zero-padded up to one (exact, the padding adds
zero terms) and the chunk size must be a power of two >= 16.
Sweep refs hold one head's whole sequence: k, q [T, BK]; v, do [T, BV]; w, alpha [T]; lam [N]; the
states [N, BK, BV] and the initial and final ones [BK, BV]. Chunk kernel refs hold one chunk:
q, k [C, K] (dqdk: [C, BK]); v, do [C, BV] (dqdk: [C, V]); h, dh [K, BV] (dqdk: [BK, V]); factors [C].
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, K key dim, V value dim (or a
block of either).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling2.kernels import vma
from ling2.kernels.triton_blocks import dot, pad_last, pad_state, pow2

BLOCK_K = 64  # key columns per dqdk program
BLOCK_V = 64  # value columns per out / dv program
SWEEP_BLOCK_K = SWEEP_BLOCK_V = 64  # the state block a sweep program carries
SWEEP_WARPS, SWEEP_STAGES = 4, 3
CHUNK_WARPS, CHUNK_STAGES = 4, 2
STATE_DTYPE = None  # the stored h_n and dh_n; None: q's dtype (the same numbers as fp32 for bf16 inputs)


def _rows(n, C):
    return pl.ds(pl.multiple_of(n * C, C), C)


def _decay(b_ref, doc_ref, scale, transpose=False):
    """D [C, C] from one chunk's b and doc [C] (transpose: D^T, rows indexed by key position)."""
    b_C, doc_C = b_ref[...], doc_ref[...]
    C = b_C.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    diff_CC = b_C[:, None] - b_C[None, :]
    causal_CC = col >= row if transpose else row >= col
    mask_CC = causal_CC & (doc_C[:, None] == doc_C[None, :])
    return jnp.exp(jnp.where(mask_CC, -diff_CC if transpose else diff_CC, -jnp.inf)) * scale


def _states_kernel(k_ref, v_ref, w_ref, lam_ref, h0_ref, h_ref, hT_ref, *, C):
    dt = k_ref.dtype

    def body(n, S_KV):
        s = _rows(n, C)
        h_ref[n] = S_KV.astype(h_ref.dtype)
        wv_CV = v_ref[s, :] * w_ref[s][:, None]
        return lam_ref[n] * S_KV + dot(k_ref[s, :], wv_CV, dt, ta=True)

    hT_ref[...] = jax.lax.fori_loop(0, h_ref.shape[0], body, h0_ref[...])


def _dstates_kernel(q_ref, do_ref, alpha_ref, lam_ref, dhT_ref, dh_ref, dh0_ref, *, scale, C):
    N, dt = dh_ref.shape[0], q_ref.dtype

    def body(r, G_KV):
        n = N - 1 - r
        s = _rows(n, C)
        dh_ref[n] = G_KV.astype(dh_ref.dtype)
        ado_CV = do_ref[s, :] * (scale * alpha_ref[s])[:, None]
        return lam_ref[n] * G_KV + dot(q_ref[s, :], ado_CV, dt, ta=True)

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dhT_ref[...])


def _scores_and_state(a_ref, b_ref, s_ref, width, BK):
    """(a b^T [C, C], a s [C, width]) summed over K blocks of BK: a chunk's scores and its state term."""
    C, K = a_ref.shape
    dt = a_ref.dtype

    def body(i, acc):
        ab_CC, as_CV = acc
        ks = pl.ds(pl.multiple_of(i * BK, BK), BK)
        a_CK = a_ref[:, ks]
        return ab_CC + dot(a_CK, b_ref[:, ks], dt, tb=True), as_CV + dot(a_CK, s_ref[ks, :], dt)

    zeros = (jnp.zeros((C, C), jnp.float32), jnp.zeros((C, width), jnp.float32))
    return jax.lax.fori_loop(0, K // BK, body, zeros)


def _out_kernel(q_ref, k_ref, v_ref, h_ref, b_ref, doc_ref, alpha_ref, o_ref, *, scale, BK):
    qk_CC, qh_CV = _scores_and_state(q_ref, k_ref, h_ref, o_ref.shape[1], BK)
    A_CC = qk_CC * _decay(b_ref, doc_ref, scale)
    o_CV = dot(A_CC, v_ref[...], q_ref.dtype) + (scale * alpha_ref[...])[:, None] * qh_CV
    o_ref[...] = o_CV.astype(o_ref.dtype)


def _dv_kernel(q_ref, k_ref, do_ref, dh_ref, b_ref, doc_ref, w_ref, dv_ref, *, scale, BK):
    kq_CC, kdh_CV = _scores_and_state(k_ref, q_ref, dh_ref, dv_ref.shape[1], BK)
    At_CC = kq_CC * _decay(b_ref, doc_ref, scale, transpose=True)
    dv_ref[...] = dot(At_CC, do_ref[...], q_ref.dtype) + w_ref[...][:, None] * kdh_CV


def _dqdk_kernel(q_ref, k_ref, v_ref, do_ref, h_ref, dh_ref, b_ref, doc_ref, alpha_ref, w_ref, dq_ref, dk_ref,
                 *, scale, BV):
    C, V = v_ref.shape
    dt = q_ref.dtype

    def body(j, acc):
        dA_CC, doh_CK, vdh_CK = acc
        vs = pl.ds(pl.multiple_of(j * BV, BV), BV)
        do_CV, v_CV = do_ref[:, vs], v_ref[:, vs]
        return (dA_CC + dot(do_CV, v_CV, dt, tb=True), doh_CK + dot(do_CV, h_ref[:, vs], dt, tb=True),
                vdh_CK + dot(v_CV, dh_ref[:, vs], dt, tb=True))

    zeros_CK = jnp.zeros(dq_ref.shape, jnp.float32)
    dA_CC, doh_CK, vdh_CK = jax.lax.fori_loop(0, V // BV, body, (jnp.zeros((C, C), jnp.float32), zeros_CK, zeros_CK))
    dA_CC = dA_CC * _decay(b_ref, doc_ref, scale)
    dq_ref[...] = dot(dA_CC, k_ref[...], dt) + (scale * alpha_ref[...])[:, None] * doh_CK
    dk_ref[...] = dot(dA_CC, q_ref[...], dt, ta=True) + w_ref[...][:, None] * vdh_CK


def supports_chunk(C):
    """Triton block shapes: the chunk must be a power of two >= 16."""
    return C >= 16 and C & (C - 1) == 0


def _check(C):
    if not supports_chunk(C):
        raise ValueError(f"pallas_gpu: chunk_size={C} must be a power of two >= 16 (Triton block shapes)")


class _Layout:
    """Padded head dims, blocks and BlockSpecs for one call. Sweep grids are (V blocks, K blocks, B, H), chunk
    grids (blocks, N, B, H); the block axis first, so the programs launched together share their chunk."""

    def __init__(self, q, v, C, block_k, block_v):
        _check(C)
        self.B, self.H, self.T, self.K0 = q.shape
        self.V0, self.C, self.N = v.shape[-1], C, self.T // C
        self.K, self.V = pow2(self.K0), pow2(self.V0)
        self.BK, self.BV = min(self.K, block_k or BLOCK_K), min(self.V, block_v or BLOCK_V)
        self.NK, self.NV = self.K // self.BK, self.V // self.BV
        self.SK, self.SV = min(self.K, block_k or SWEEP_BLOCK_K), min(self.V, block_v or SWEEP_BLOCK_V)
        self.sweep_grid = (self.V // self.SV, self.K // self.SK, self.B, self.H)

    # Sweeps: grid (j, i, b, h) over V blocks j and K blocks i of the state (SV and SK wide).
    def seq(self, by_k):
        """[B, H, T, K] (by_k) or [B, H, T, V] -> one head's sequence, block i of K or block j of V."""
        return pl.BlockSpec((None, None, self.T, self.SK if by_k else self.SV),
                            lambda j, i, b, h: (b, h, 0, i if by_k else j))

    def seq_vec(self, length):
        """[B, H, length] (per token or per chunk) -> one head's entries."""
        return pl.BlockSpec((None, None, length), lambda j, i, b, h: (b, h, 0))

    def state(self):
        """[B, H, K, V] -> a [SK, SV] block."""
        return pl.BlockSpec((None, None, self.SK, self.SV), lambda j, i, b, h: (b, h, i, j))

    def states(self):
        """[B, H, N, K, V] -> every chunk's [SK, SV] block."""
        return pl.BlockSpec((None, None, self.N, self.SK, self.SV), lambda j, i, b, h: (b, h, 0, i, j))

    # Chunk kernels: grid (x, n, b, h) over blocks x and chunks n.
    def chunk(self, D):
        """[B, H, T, D] -> chunk n, all D columns."""
        return pl.BlockSpec((None, None, self.C, D), lambda x, n, b, h: (b, h, n, 0))

    def chunk_block(self, BD):
        """[B, H, T, D] -> chunk n, columns block x of BD."""
        return pl.BlockSpec((None, None, self.C, BD), lambda x, n, b, h: (b, h, n, x))

    def chunk_vec(self):
        """[B, H, T] -> chunk n."""
        return pl.BlockSpec((None, None, self.C), lambda x, n, b, h: (b, h, n))

    def chunk_state(self, by_k):
        """[B, H, N, K, V] -> chunk n's state, K block x by all V (by_k) or all K by V block x."""
        shape = (self.BK, self.V) if by_k else (self.K, self.BV)
        return pl.BlockSpec((None, None, None) + shape,
                            lambda x, n, b, h: (b, h, n, x, 0) if by_k else (b, h, n, 0, x))


def _call(kernel, name, grid, in_specs, out_specs, outs, args, warps, stages, interpret):
    """One named Triton kernel (the name is what compiled HLO calls it) with its warps and pipeline stages."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=outs, interpret=interpret, name=name,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
    )(*args)


def _lam(aux, L):
    """lam [B, H, N]: alpha of each chunk's last token, the state's decay over the chunk (0 on a reset)."""
    return aux["alpha"].reshape(L.B, L.H, L.N, L.C)[..., -1]


def _states(k, v, aux, h0, L, like, interpret):
    """Padded k, v -> the states entering every chunk [B, H, N, K, V] (STATE_DTYPE) and the final state."""
    f32 = jnp.float32
    outs = [vma.out_struct((L.B, L.H, L.N, L.K, L.V), STATE_DTYPE or k.dtype, like),
            vma.out_struct((L.B, L.H, L.K, L.V), f32, like)]
    return _call(functools.partial(_states_kernel, C=L.C), "ling2_gla_states", L.sweep_grid,
                 [L.seq(True), L.seq(False), L.seq_vec(L.T), L.seq_vec(L.N), L.state()],
                 [L.states(), L.state()], outs, (k, v, aux["w"], _lam(aux, L), pad_state(h0, L.K, L.V)),
                 SWEEP_WARPS, SWEEP_STAGES, interpret)


def forward(q, k, v, aux, h0, scale, C, *, interpret=False, block_k=None, block_v=None):
    L = _Layout(q, v, C, block_k, block_v)
    q, k, v = pad_last(q, L.K), pad_last(k, L.K), pad_last(v, L.V)
    h_BHNKV, hT_BHKV = _states(k, v, aux, h0, L, q, interpret)
    doc = aux["doc"].astype(jnp.float32)
    (o_BHTV,) = _call(functools.partial(_out_kernel, scale=scale, BK=L.BK), "ling2_gla_out", (L.NV, L.N, L.B, L.H),
                      [L.chunk(L.K), L.chunk(L.K), L.chunk_block(L.BV), L.chunk_state(False)] + [L.chunk_vec()] * 3,
                      [L.chunk_block(L.BV)], [vma.out_struct((L.B, L.H, L.T, L.V), q.dtype, q)],
                      (q, k, v, h_BHNKV, aux["b"], doc, aux["alpha"]), CHUNK_WARPS, CHUNK_STAGES, interpret)
    return o_BHTV[..., :L.V0], hT_BHKV[:, :, :L.K0, :L.V0]


def backward(q, k, v, aux, h0, do, dhT, scale, C, *, interpret=False, block_k=None, block_v=None):
    """The states again (states sweep), dL/d(state leaving every chunk) (dstates sweep), then dv and dq, dk of
    every chunk at once."""
    L = _Layout(q, v, C, block_k, block_v)
    f32 = jnp.float32
    q, k, v, do = pad_last(q, L.K), pad_last(k, L.K), pad_last(v, L.V), pad_last(do, L.V)
    h_BHNKV, _ = _states(k, v, aux, h0, L, q, interpret)
    dh_BHNKV, dh0_BHKV = _call(
        functools.partial(_dstates_kernel, scale=scale, C=L.C), "ling2_gla_dstates", L.sweep_grid,
        [L.seq(True), L.seq(False), L.seq_vec(L.T), L.seq_vec(L.N), L.state()], [L.states(), L.state()],
        [vma.out_struct((L.B, L.H, L.N, L.K, L.V), STATE_DTYPE or q.dtype, q),
         vma.out_struct((L.B, L.H, L.K, L.V), f32, q)],
        (q, do, aux["alpha"], _lam(aux, L), pad_state(dhT, L.K, L.V)), SWEEP_WARPS, SWEEP_STAGES, interpret)
    doc = aux["doc"].astype(f32)
    (dv_BHTV,) = _call(
        functools.partial(_dv_kernel, scale=scale, BK=L.BK), "ling2_gla_dv", (L.NV, L.N, L.B, L.H),
        [L.chunk(L.K), L.chunk(L.K), L.chunk_block(L.BV), L.chunk_state(False)] + [L.chunk_vec()] * 3,
        [L.chunk_block(L.BV)], [vma.out_struct((L.B, L.H, L.T, L.V), f32, q)],
        (q, k, do, dh_BHNKV, aux["b"], doc, aux["w"]), CHUNK_WARPS, CHUNK_STAGES, interpret)
    dq_BHTK, dk_BHTK = _call(
        functools.partial(_dqdk_kernel, scale=scale, BV=L.BV), "ling2_gla_dqdk", (L.NK, L.N, L.B, L.H),
        [L.chunk_block(L.BK), L.chunk_block(L.BK), L.chunk(L.V), L.chunk(L.V), L.chunk_state(True),
         L.chunk_state(True)] + [L.chunk_vec()] * 4,
        [L.chunk_block(L.BK)] * 2, [vma.out_struct((L.B, L.H, L.T, L.K), f32, q)] * 2,
        (q, k, v, do, h_BHNKV, dh_BHNKV, aux["b"], doc, aux["alpha"], aux["w"]), CHUNK_WARPS, CHUNK_STAGES,
        interpret)
    return dq_BHTK[..., :L.K0], dk_BHTK[..., :L.K0], dv_BHTV[..., :L.V0], dh0_BHKV[:, :, :L.K0, :L.V0]
