"""Pallas GPU (Triton) kernels for chunked KDA: two prologue kernels for each chunk's state-free
math, then the recurrence across chunks.

Prologue (chunk_math.prologue's quantities; the chunk is cut into SUB-token sub-chunks). Per
sub-chunk, lb = sum of g over [sub-chunk start, i] (a cumsum), tl = sum over (i, sub-chunk end]
and tot = the sub-chunk's sum, so every exponent is a sum of gates over a span, <= 0 (finite under
any gate).
  pairs kernel, grid (B, H, N * C / SUB), one program per row block s of a chunk: its rows of
    Akk0 and Aqk. Block (s, s) by chunk_math's levels on the sub-chunk; block (s, r), r < s, as
    e^{b_i - b_j} = e^{lb_i} e^{tot_{r+1} + .. + tot_{s-1}} e^{tl_j}: [SUB, K] x [K, SUB] matmuls of
    decayed q and k, summed over BLOCK_K-wide key blocks. Also alpha, omega (from the sums of tot
    before and after s), q alpha, k omega and beta k alpha.
  solve kernel, grid (B, H, N): T = (I + diag(beta) Akk0)^-1 on [SUB, SUB] blocks, the diagonal
    blocks by chunk_math.intra's level formula, the others by block forward substitution
      T_sr = -T_ss sum_{m=r}^{s-1} (diag(beta) Akk0)_sm T_mr,
    then W = T (beta k alpha), U = T diag(beta) v and lam.
They write the sweep operands in the sweeps' layout (and, for the backward, alpha, omega, Akk0
and T, which the gradients read). Split this way (row blocks, key blocks, a separate solve)
each program's live tiles fit in registers: one program per chunk doing it all spilled (NOTES.md).
Sweeps: a few matmuls per chunk, sequential over chunks, on grid (B, H, V / BLOCK_V), each
program looping over the N chunks with its fp32 slice of the state (K x BLOCK_V) in registers:
  forward: delta = U - W S;  o = scale (q alpha) S + Aqk delta;  S <- lam S + (k omega)^T delta
           (o and the final state; for the backward, the state entering every chunk instead).
  reverse: G <- lam G - W^T ((k omega) G) + Vc, with G = dL/d(state leaving the chunk) and
           Vc = scale (q alpha)^T do - W^T (Aqk^T do) batched beforehand (G of every chunk, d h0).
Gradients, given every chunk's entering state S and dL/d(leaving state) G (chunk_math.backward's math), as
two kernels over all chunks at once:
  value side, grid (B, H, N), over V blocks in turn: delta = U - W S, dr = T^T (Aqk^T do + kw G), dv = beta dr,
    and the [C, C] cotangents dAqk = mask(do delta^T), dAkk0 = -mask(dr delta^T) (x beta) and dbeta;
  key side, grid (K / GRAD_BLOCK_K, N, B, H): per key block, dq, dk and dg from those, by the same levels as the
    prologue (each key column's gradients need only its own column of q, k and g).
(GRAD_KERNELS off: chunk_math.backward vmapped, as batched XLA.)
Precision as the other backends' bf16 path (chunk_math.Dots with TF32 for the decay products
and the solve, full fp32 for gate sums): data matmuls take operands in the input dtype, the state
and accumulation are fp32.
Triton needs power-of-two block shapes: K and V are zero-padded up to one (exact: padded key dims
have zero q, k, W and state rows) and the chunk size is a power of two >= 16 (= SUB).
Sweep refs hold one head's whole sequence: qa (q alpha), W, kw (k omega) [T, K]; Aqk [T, C]; U, o
[T, BLOCK_V]; lam [N, K]; states and their gradients [K, BLOCK_V] ([N, K, BLOCK_V] per chunk).
Axes in names: B batch, H heads, T time (padded), N chunks, C chunk size, S sub-chunk (SUB tokens),
K key dim, V value dim (or a block of it).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling2.kernels import vma
from ling2.kernels.kda import chunk_math as chunk
from ling2.kernels.kda import chunked
from ling2.kernels.triton_blocks import dot, grid_call, pad_last, pad_state, pow2

_HI = jax.lax.Precision.HIGHEST
BLOCK_V = 64  # state columns per sweep program
SWEEP_WARPS = 4
SWEEP_STAGES = 3  # the sweeps' loads of chunk n + 2 in flight during chunk n (tools/bench/kda/NOTES.md)
GRAD_KERNELS = True  # the backward's per-chunk gradients as two kernels (else chunk_math.backward, batched XLA)
GRAD_BLOCK_V = 32  # value columns per step of the V-side gradient kernel
GRAD_BLOCK_K = 32  # key columns per program of the K-side gradient kernel
VGRAD_WARPS, KGRAD_WARPS, GRAD_STAGES = 4, 8, 2  # ptxas (sm_90a): 255 registers, no / 96 bytes of spills
SUB = 16  # tokens per sub-chunk of the prologue (row blocks of the pair kernel, diagonal blocks of the solve)
BLOCK_K = 32  # key dims per step of the pairs kernel's products (its matmul operands stay in registers)
PAIRS_WARPS = 4
SOLVE_WARPS = 4
PROLOGUE_STAGES = 1


def _dots(dt):
    return chunk.Dots(dt, mid_low=jax.lax.Precision.HIGH)  # TF32 for the decay products and the inverse


def _chunk(n, C):
    return pl.ds(pl.multiple_of(n * C, C), C)


def _pairs_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, first_ref, last_ref, *out_refs, scale, full):
    """Row block s (the program's third index mod C / SUB) of one chunk: q, k, g [C, K] and beta, doc, first,
    last [C] in (the whole chunk); its rows of Aqk and Akk0 [SUB, C], qa, kw and beta k alpha [SUB, K] out
    (full: also alpha, omega [SUB, K] fp32). Products are summed over BLOCK_K-wide key blocks, so a matmul's
    operands stay a few registers per thread."""
    A_ref, Akk_ref, qa_ref, kw_ref, bka_ref = out_refs[:5]
    dots = _dots(q_ref.dtype)
    acc = dots.acc
    C, K = q_ref.shape
    nS, BK = C // SUB, min(K, BLOCK_K)
    s = jax.lax.rem(pl.program_id(2), nS)
    rows = lambda r: pl.ds(pl.multiple_of(r * SUB, SUB), SUB)
    cols = lambda c: pl.ds(pl.multiple_of(c * BK, BK), BK)
    over_keys = lambda body, init: jax.lax.fori_loop(0, K // BK, body, init)
    i_SS = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    j_SS = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    after_SS = dots.mask(j_SS > i_SS)
    beta_S1 = beta_ref[rows(s)].astype(acc)[:, None]
    doc_S = doc_ref[rows(s)]
    zero_SS = beta_S1 * dots.mask(i_SS < 0)  # (zeros shaped like the data, as chunk_math.intra's)
    load = lambda ref, r, c: ref[rows(r), cols(c)]
    gate = lambda r, c: load(g_ref, r, c).astype(acc)

    def span(c, a, b):
        """Gate sum over sub-chunks a .. b - 1 on key block c [BK]."""
        return jax.lax.fori_loop(a, b, lambda r, x_K: x_K + jnp.sum(gate(r, c), axis=0),
                                 jnp.sum(gate(s, c), axis=0) * 0.0)

    def decays(c, carry):
        g_SK, q_SK, k_SK = gate(s, c), load(q_ref, s, c), load(k_ref, s, c)
        alpha_SK = jnp.where(first_ref[rows(s)][:, None] > 0, jnp.exp(jnp.cumsum(g_SK, axis=0) + span(c, 0, s)), 0.0)
        omega_SK = jnp.where(last_ref[rows(s)][:, None] > 0,
                             jnp.exp(dots.exact(after_SS, g_SK) + span(c, s + 1, nS)), 0.0)
        qa_ref[:, cols(c)] = (q_SK * alpha_SK).astype(qa_ref.dtype)
        kw_ref[:, cols(c)] = (k_SK * omega_SK).astype(kw_ref.dtype)
        bka_ref[:, cols(c)] = (beta_S1 * k_SK.astype(acc) * alpha_SK).astype(bka_ref.dtype)
        if full:
            out_refs[5][:, cols(c)] = alpha_SK.astype(out_refs[5].dtype)
            out_refs[6][:, cols(c)] = omega_SK.astype(out_refs[6].dtype)
        return carry + jnp.sum(q_SK.astype(acc) * k_SK.astype(acc), axis=1, keepdims=True)

    qk_S1 = over_keys(decays, beta_S1 * 0.0)

    def level(l, carry):  # the diagonal block's level-l pairs
        def part(c, P):
            q_SK, k_SK = load(q_ref, s, c), load(k_ref, s, c)
            e_SK = chunk.level_exp(gate(s, c), l, dots)
            qe_SK, ke_SK = q_SK * e_SK, k_SK * e_SK
            return P[0] + dots.mid(qe_SK, ke_SK, tb=True), P[1] + dots.mid(ke_SK, ke_SK, tb=True)

        Pq_SS, Pk_SS = over_keys(part, (zero_SS, zero_SS))
        m_SS = chunk.level_mask(SUB, l)
        return carry[0] + jnp.where(m_SS, scale * Pq_SS, 0.0), carry[1] + jnp.where(m_SS, Pk_SS, 0.0)

    Aqk_SS, Akk_SS = jax.lax.fori_loop(0, len(chunk.levels(SUB)), level,
                                       (jnp.where(i_SS == j_SS, scale * qk_S1, zero_SS), zero_SS))
    same_SS = doc_S[:, None] == doc_S[None, :]
    A_ref[:, rows(s)] = jnp.where(same_SS, Aqk_SS, 0.0).astype(A_ref.dtype)
    Akk_ref[:, rows(s)] = jnp.where(same_SS, Akk_SS, 0.0).astype(Akk_ref.dtype)

    def block(r, carry):  # block (s, r), r < s: e^{lb_i} e^{gates of sub-chunks r+1 .. s-1} e^{tl_j}
        def part(c, P):
            e_SK = jnp.exp(jnp.cumsum(gate(s, c), axis=0))
            qd_SK, kd_SK = load(q_ref, s, c) * e_SK, load(k_ref, s, c) * e_SK
            kt_SK = load(k_ref, r, c) * jnp.exp(dots.exact(after_SS, gate(r, c)) + span(c, r + 1, s))
            return P[0] + dots.mid(qd_SK, kt_SK, tb=True), P[1] + dots.mid(kd_SK, kt_SK, tb=True)

        Pq_SS, Pk_SS = over_keys(part, (zero_SS, zero_SS))
        same_SS = doc_S[:, None] == doc_ref[rows(r)][None, :]
        A_ref[:, rows(r)] = jnp.where(same_SS, scale * Pq_SS, 0.0).astype(A_ref.dtype)
        Akk_ref[:, rows(r)] = jnp.where(same_SS, Pk_SS, 0.0).astype(Akk_ref.dtype)
        return carry

    jax.lax.fori_loop(0, s, block, 0)

    def zeros(r, carry):
        A_ref[:, rows(r)] = zero_SS.astype(A_ref.dtype)
        Akk_ref[:, rows(r)] = zero_SS.astype(Akk_ref.dtype)
        return carry

    jax.lax.fori_loop(s + 1, nS, zeros, 0)


def _solve_kernel(Akk_ref, beta_ref, bka_ref, v_ref, g_ref, first_ref, W_ref, U_ref, lam_ref, *T_ref):
    """One chunk: Akk0 [C, C] fp32, beta [C], beta k alpha [C, K], v [C, V], g [C, K], first [C] in; T =
    (I + diag(beta) Akk0)^-1 by blocks, W = T (beta k alpha) [C, K], U = T diag(beta) v [C, V] and lam [K] out
    (and T [C, C] if asked)."""
    dots = _dots(v_ref.dtype)
    acc = dots.acc
    nS = v_ref.shape[0] // SUB
    rows = lambda s: pl.ds(s * SUB, SUB)
    i_SS = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    j_SS = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    beta_S1 = [beta_ref[rows(s)].astype(acc)[:, None] for s in range(nS)]
    bA = lambda s, r: beta_S1[s] * Akk_ref[rows(s), rows(r)]
    Tb = {}
    for s in range(nS):
        T_SS = jnp.where(i_SS == j_SS, 1.0, 0.0 * beta_S1[s])
        for l in chunk.levels(SUB):  # the diagonal block's inverse, as chunk_math.intra
            T_SS = T_SS - dots.mid(dots.mid(T_SS, jnp.where(chunk.level_mask(SUB, l), bA(s, s), 0.0)), T_SS)
        Tb[s, s] = T_SS
        for r in range(s):
            Tb[s, r] = -dots.mid(T_SS, sum(dots.mid(bA(s, m), Tb[m, r]) for m in range(r, s)))
        U_ref[rows(s), :] = sum(dots.data(Tb[s, r], beta_S1[r] * v_ref[rows(r), :].astype(acc))
                                for r in range(s + 1)).astype(U_ref.dtype)
        W_ref[rows(s), :] = sum(dots.data(Tb[s, r], bka_ref[rows(r), :]) for r in range(s + 1)).astype(W_ref.dtype)
        for r in range(nS) if T_ref else ():
            T_ref[0][rows(s), rows(r)] = Tb.get((s, r), 0.0 * T_SS).astype(T_ref[0].dtype)
    last_S = jax.lax.broadcasted_iota(jnp.int32, (SUB,), 0) == SUB - 1
    keep = jnp.sum(jnp.where(last_S, first_ref[rows(nS - 1)].astype(acc), 0.0))  # 0 if a document starts here
    lam_ref[...] = (jnp.exp(sum(jnp.sum(g_ref[rows(s), :].astype(acc), axis=0) for s in range(nS)))
                    * keep).astype(lam_ref.dtype)


def _prologue(q, k, v, g, beta, aux, scale, C, full, interpret):
    """The two prologue kernels on padded q, k, g [B, H, T, K], v [B, H, T, V], beta [B, H, T] and aux: qa, kw, W
    [B, H, T, K] and Aqk [B, H, T, C] in q's dtype, U [B, H, T, V] and lam [B, H, N, K] fp32 (full: also alpha,
    omega [B, H, T, K] and Akk0 [B, H, T, C] fp32, T [B, H, T, C] in q's dtype)."""
    B, H, T, K = q.shape
    V, N, nS, dt, f32 = v.shape[-1], T // C, C // SUB, q.dtype, jnp.float32
    out = lambda D, d: vma.out_struct((B, H, T, D), d, q)
    params = lambda warps: None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=PROLOGUE_STAGES)
    first, last = aux["first"].astype(f32), aux["last"].astype(f32)
    chunk_of = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, m: (b, h, m // nS, 0))
    col_of = lambda head: pl.BlockSpec((None, None, C), lambda b, h, m: (b, h if head else 0, m // nS))
    row_of = lambda D: pl.BlockSpec((None, None, SUB, D), lambda b, h, m: (b, h, m, 0))
    pair_shapes = [(C, dt), (C, f32), (K, dt), (K, dt), (K, dt)] + ([(K, f32), (K, f32)] if full else [])
    A, Akk, qa, kw, bka, *alpha_omega = pl.pallas_call(
        functools.partial(_pairs_kernel, scale=scale, full=full), grid=(B, H, N * nS),
        in_specs=[chunk_of(K), chunk_of(K), chunk_of(K), col_of(True), col_of(False), col_of(False), col_of(False)],
        out_specs=[row_of(D) for D, _ in pair_shapes], out_shape=[out(D, d) for D, d in pair_shapes],
        interpret=interpret, compiler_params=params(PAIRS_WARPS),
    )(q, k, g, beta, aux["doc"].astype(jnp.int32), first, last)
    tok = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    col = lambda head: pl.BlockSpec((None, None, C), lambda b, h, n: (b, h if head else 0, n))
    W, U, lam, *T_inv = pl.pallas_call(
        _solve_kernel, grid=(B, H, N),
        in_specs=[tok(C), col(True), tok(K), tok(V), tok(K), col(False)],
        out_specs=[tok(K), tok(V), pl.BlockSpec((None, None, None, K), lambda b, h, n: (b, h, n, 0))]
        + [tok(C)] * full,
        out_shape=[out(K, dt), out(V, f32), vma.out_struct((B, H, N, K), f32, q)] + [out(C, dt)] * full,
        interpret=interpret, compiler_params=params(SOLVE_WARPS),
    )(Akk, beta, bka, v, g, first)
    return (qa, kw, W, A, U, lam) + ((*alpha_omega, Akk, *T_inv) if full else ())


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


def _vgrad_kernel(W_ref, kw_ref, ka_ref, A_ref, T_ref, Akk_ref, U_ref, v_ref, do_ref, S_ref, G_ref, beta_ref, doc_ref,
                  dAqk_ref, dAkk_ref, dbeta_ref, delta_ref, dv_ref, *, scale, BV):
    """chunk_math.backward's value side for one chunk, over its V blocks in turn: W, kw (k omega), ka (k alpha)
    [C, K], Aqk, T [C, C] in q's dtype, Akk0 [C, C], U [C, V], v, do [C, V], S (the state entering the chunk) and G
    (dL/d the state leaving it) [K, V], beta, doc [C] in; dL/dAqk and dL/d(Akk0) (times beta) [C, C], dbeta [C],
    delta [C, V] (q's dtype: the K side's matmuls take it so) and dv [C, V] out."""
    dots = _dots(W_ref.dtype)
    acc = dots.acc
    C, V = U_ref.shape
    i_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    j_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    beta_C1 = beta_ref[...].astype(acc)[:, None]
    doc_C = doc_ref[...]
    same_CC = doc_C[:, None] == doc_C[None, :]
    W_CK, kw_CK, ka_CK, A_CC, T_CC = W_ref[...], kw_ref[...], ka_ref[...], A_ref[...], T_ref[...]

    def body(j, carry):
        dA_CC, dK_CC, db_C1 = carry
        vs = pl.ds(pl.multiple_of(j * BV, BV), BV)
        S_KV, G_KV, do_CV = S_ref[:, vs], G_ref[:, vs], do_ref[:, vs]
        delta_CV = U_ref[:, vs] - dots.data(W_CK, S_KV)
        dr_CV = dots.data(T_CC, dots.data(A_CC, do_CV, ta=True) + dots.data(kw_CK, G_KV), ta=True)
        rv_CV = v_ref[:, vs].astype(acc) - dots.data(ka_CK, S_KV)
        delta_ref[:, vs] = delta_CV.astype(delta_ref.dtype)
        dv_ref[:, vs] = (beta_C1 * dr_CV).astype(dv_ref.dtype)
        return (dA_CC + dots.data(do_CV, delta_CV, tb=True), dK_CC - dots.data(dr_CV, delta_CV, tb=True),
                db_C1 + jnp.sum(dr_CV * rv_CV, axis=1, keepdims=True))

    zero_CC = beta_C1 * dots.mask(i_CC < 0)
    dA_CC, dK_CC, db_C1 = jax.lax.fori_loop(0, V // BV, body, (zero_CC, zero_CC, beta_C1 * 0.0))
    dK_CC = jnp.where((i_CC > j_CC) & same_CC, dK_CC, 0.0)
    dAqk_ref[...] = jnp.where((i_CC >= j_CC) & same_CC, scale * dA_CC, 0.0).astype(dAqk_ref.dtype)
    dAkk_ref[...] = (beta_C1 * dK_CC).astype(dAkk_ref.dtype)
    dbeta_ref[...] = jnp.sum(db_C1 + jnp.sum(dK_CC * Akk_ref[...], axis=1, keepdims=True), axis=1)


def _kgrad_kernel(q_ref, k_ref, g_ref, alpha_ref, omega_ref, do_ref, delta_ref, dv_ref, S_ref, G_ref, lam_ref,
                  dAqk_ref, dAkk_ref, dq_ref, dk_ref, dg_ref, *, scale):
    """chunk_math.backward's key side for one chunk and one block of key columns: q, k, g, alpha, omega [C, BK];
    do, delta, dv [C, V]; S, G [BK, V] (this block's rows); lam [BK]; the value side's dL/dAqk and dL/dAkk [C, C]
    in; dq, dk, dg [C, BK] out. Each key column's gradients need only its own column of q, k and g."""
    dots = _dots(q_ref.dtype)
    acc = dots.acc
    C = q_ref.shape[0]
    q_CK, k_CK, g_CK = q_ref[...].astype(acc), k_ref[...].astype(acc), g_ref[...].astype(acc)
    alpha_CK, omega_CK = alpha_ref[...], omega_ref[...]
    S_KV, G_KV = S_ref[...], G_ref[...]
    dqa_CK = scale * dots.data(do_ref[...], S_KV, tb=True)
    dkw_CK = dots.data(delta_ref[...], G_KV, tb=True)
    dka_CK = -dots.data(dv_ref[...], S_KV, tb=True)
    t_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    u_CC = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    diag_C1 = jnp.sum(jnp.where(t_CC == u_CC, dAqk_ref[...], 0.0), axis=1, keepdims=True)
    kw_CK = k_CK * omega_CK
    dq_CK = diag_C1 * k_CK + alpha_CK * dqa_CK
    dk_CK = diag_C1 * q_CK + alpha_CK * dka_CK + omega_CK * dkw_CK
    db_CK = q_CK * alpha_CK * dqa_CK + k_CK * alpha_CK * dka_CK - kw_CK * dkw_CK

    def level(l, carry):  # as chunk_math.backward's levels (dAqk, dAkk read in each: 96 bytes of spills, not 112)
        dq_CK, dk_CK, db_CK = carry
        e_CK = chunk.level_exp(g_CK, l, dots)
        qe_CK, ke_CK = q_CK * e_CK, k_CK * e_CK
        m_CC = chunk.level_mask(C, l)
        Dq_CC, Dk_CC = jnp.where(m_CC, dAqk_ref[...], 0.0), jnp.where(m_CC, dAkk_ref[...], 0.0)
        dq_l_CK = e_CK * dots.mid(Dq_CC, ke_CK)
        dk_row_CK = e_CK * dots.mid(Dk_CC, ke_CK)
        dk_col_CK = e_CK * (dots.mid(Dq_CC, qe_CK, ta=True) + dots.mid(Dk_CC, ke_CK, ta=True))
        return (dq_CK + dq_l_CK, dk_CK + dk_row_CK + dk_col_CK,
                db_CK + q_CK * dq_l_CK + k_CK * dk_row_CK - k_CK * dk_col_CK)

    dq_CK, dk_CK, db_CK = jax.lax.fori_loop(0, len(chunk.levels(C)), level, (dq_CK, dk_CK, db_CK))
    # dg_t = sum_{i >= t} db_i; the last token's db also gets sum_c kw_c dkw_c and sum_v lam S G.
    tail_1K = (jnp.sum(kw_CK * dkw_CK, axis=0) + jnp.sum(lam_ref[...][:, None] * S_KV * G_KV, axis=1))[None, :]
    dq_ref[...] = dq_CK.astype(dq_ref.dtype)
    dk_ref[...] = dk_CK.astype(dk_ref.dtype)
    dg_ref[...] = (dots.exact(dots.mask(u_CC >= t_CC), db_CK) + tail_1K).astype(dg_ref.dtype)


def _grads(q, k, g, v, do, beta, aux, ops, S_BHNKV, G_BHNKV, scale, C, interpret):
    """Every chunk's dq, dk, dg [B, H, T, K], dv [B, H, T, V] and dbeta [B, H, T] (fp32) from the padded inputs, the
    prologue's operands and the two sweeps' states, by the value-side then the key-side kernel."""
    B, H, T, K = q.shape
    V, N, dt, f32 = v.shape[-1], T // C, q.dtype, jnp.float32
    BV, BK = min(V, GRAD_BLOCK_V), min(K, GRAD_BLOCK_K)
    params = lambda warps: None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=GRAD_STAGES)
    tok = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    vec = lambda head: pl.BlockSpec((None, None, C), lambda b, h, n: (b, h if head else 0, n))
    state = pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, n, 0, 0))
    out = lambda D, d: vma.out_struct((B, H, T, D), d, q)
    ka = (k.astype(f32) * ops["alpha"]).astype(dt)
    dAqk, dAkk, dbeta, delta, dv = pl.pallas_call(
        functools.partial(_vgrad_kernel, scale=scale, BV=BV), grid=(B, H, N),
        in_specs=[tok(K)] * 3 + [tok(C)] * 3 + [tok(V)] * 3 + [state] * 2 + [vec(True), vec(False)],
        out_specs=[tok(C), tok(C), vec(True), tok(V), tok(V)],
        out_shape=[out(C, f32), out(C, f32), vma.out_struct((B, H, T), f32, q), out(V, dt), out(V, f32)],
        interpret=interpret, compiler_params=params(VGRAD_WARPS), name="ling2_kda_vgrad",
    )(ops["W"], ops["kw"], ka, ops["A"], ops["T"], ops["Akk0"], ops["U"], v, do, S_BHNKV, G_BHNKV, beta,
      aux["doc"].astype(jnp.int32))
    kblk = lambda D: pl.BlockSpec((None, None, C, D), lambda x, n, b, h: (b, h, n, x))
    ktok = lambda D: pl.BlockSpec((None, None, C, D), lambda x, n, b, h: (b, h, n, 0))
    kstate = pl.BlockSpec((None, None, None, BK, V), lambda x, n, b, h: (b, h, n, x, 0))
    dq, dk, dg = pl.pallas_call(
        functools.partial(_kgrad_kernel, scale=scale), grid=(K // BK, N, B, H),
        in_specs=[kblk(BK)] * 5 + [ktok(V)] * 3 + [kstate] * 2
        + [pl.BlockSpec((None, None, None, BK), lambda x, n, b, h: (b, h, n, x))] + [ktok(C)] * 2,
        out_specs=[kblk(BK)] * 3, out_shape=[out(K, f32)] * 3,
        interpret=interpret, compiler_params=params(KGRAD_WARPS), name="ling2_kda_kgrad",
    )(q, k, g, ops["alpha"], ops["omega"], do, delta, dv, S_BHNKV, G_BHNKV, ops["lam"], dAqk, dAkk)
    return dq, dk, dv, dg, dbeta


def _check(C):
    if C < SUB or C & (C - 1):
        raise ValueError(f"pallas_gpu: chunk_size={C} must be a power of two >= {SUB} (Triton block shapes)")


def _sweep_inputs(q, k, v, g, beta, aux, scale, C, *extra, interpret=False):
    """Every chunk's prologue (the two prologue kernels), and the sweep operands padded for Triton.

    Returns (chunks, p, ops, K, V): chunks, chunked.per_chunk's views of the inputs and extra; p, with extra (the
    backward's do), chunk_math.prologue's dict for every chunk ([B, H, N, ...], what chunk_math.backward reads),
    else None; ops, the sweep operands qa, W, kw [B, H, T, K] and Aqk ("A") [B, H, T, C] in q's dtype, U
    [B, H, T, V] and lam [B, H, N, K] fp32; K, V the padded head dims."""
    B, H, T, K0 = q.shape
    V0, N = v.shape[-1], T // C
    K, V = pow2(K0), pow2(V0)
    full = bool(extra)
    outs = _prologue(pad_last(q, K), pad_last(k, K), pad_last(v, V), pad_last(g, K), beta, aux, scale, C, full,
                     interpret)
    ops = dict(zip(("qa", "kw", "W", "A", "U", "lam"), outs[:6]))
    chunks = chunked.per_chunk(q, k, v, g, beta, aux, C, *extra)
    p = None
    if full:
        ch = lambda x_BHTD, D: x_BHTD.reshape(B, H, N, C, x_BHTD.shape[-1])[..., :D]
        alpha, omega, Akk0, T_inv = outs[6:]
        ops.update(alpha=alpha, omega=omega, Akk0=Akk0, T=T_inv)
        p = dict(same=chunks[5] == chunks[6], Aqk=ch(ops["A"], C), Akk0=ch(Akk0, C), T=ch(T_inv, C),
                 alpha=ch(alpha, K0), omega=ch(omega, K0), U=ch(ops["U"], V0), W=ch(ops["W"], K0),
                 lam=jnp.broadcast_to(ops["lam"][..., :K0, None], (B, H, N, K0, V0)))
    return chunks, p, ops, K, V


def _block(V, block_v):
    return min(V, block_v or BLOCK_V)


def forward(q, k, v, g, beta, aux, h0, scale, C, *, interpret=False, block_v=None):
    _check(C)
    B, H, T, K0 = q.shape
    V0 = v.shape[-1]
    _, _, ops, K, V = _sweep_inputs(q, k, v, g, beta, aux, scale, C, interpret=interpret)
    outs = [vma.out_struct((B, H, T, V), q.dtype, q), vma.out_struct((B, H, K, V), jnp.float32, q)]
    args = tuple(ops[n] for n in ("qa", "A", "U", "W", "kw", "lam")) + (pad_state(h0, K, V),)
    o_BHTV, hT_BHKV = grid_call(functools.partial(_fwd_kernel, scale=scale, C=C), args, outs,
                                ("full", "full", "v", "full", "full", "full", "v", "v", "v"), _block(V, block_v),
                                interpret, SWEEP_WARPS, SWEEP_STAGES)
    return o_BHTV[..., :V0], hT_BHKV[:, :, :K0, :V0].astype(h0.dtype)


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C, *, interpret=False, block_v=None):
    """The prologue kernels, the states entering every chunk (forward sweep), dL/d(state leaving every chunk)
    (reverse sweep), then every chunk's gradients at once: two kernels (GRAD_KERNELS), else chunk_math.backward
    as batched XLA."""
    _check(C)
    B, H, T, K0 = q.shape
    V0, N = v.shape[-1], T // C
    f32, dt = jnp.float32, q.dtype
    chunks, p, ops, K, V = _sweep_inputs(q, k, v, g, beta, aux, scale, C, do, interpret=interpret)
    BV = _block(V, block_v)
    S_BHNKV = grid_call(functools.partial(_states_kernel, C=C),
                        (ops["U"], ops["W"], ops["kw"], ops["lam"], pad_state(h0, K, V)),
                        [vma.out_struct((B, H, N, K, V), f32, q)], ("v", "full", "full", "full", "v", "v"), BV,
                        interpret, SWEEP_WARPS, SWEEP_STAGES)[0]
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
        ("full", "full", "full", "v", "v", "v", "v"), BV, interpret, SWEEP_WARPS, SWEEP_STAGES)
    if GRAD_KERNELS:
        pk, pv = (lambda x: pad_last(x, K)), (lambda x: pad_last(x, V))
        dq, dk, dv, dg, dbeta = _grads(pk(q), pk(k), pk(g), pv(v), pv(do), beta, aux, ops, S_BHNKV, G_BHNKV, scale, C,
                                       interpret)
        return dq[..., :K0], dk[..., :K0], dv[..., :V0], dg[..., :K0], dbeta, dh0_BHKV[:, :, :K0, :V0]
    S_BHNKV, G_BHNKV = S_BHNKV[..., :K0, :V0], G_BHNKV[..., :K0, :V0]
    dots = _dots(dt)
    grads = chunked.vmap3(lambda *a: chunk.backward(*a[:9], a[10], a[11], a[9], scale, dots, pre=a[12]))
    dq, dk, dv, dg, dbeta, _ = grads(*chunks, S_BHNKV, G_BHNKV, p)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            dbeta.reshape(B, H, T), dh0_BHKV[:, :, :K0, :V0])
