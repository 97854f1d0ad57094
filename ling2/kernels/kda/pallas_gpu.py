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
and T, which chunk_math.backward reads). Split this way (row blocks, key blocks, a separate solve)
each program's live tiles fit in registers: one program per chunk doing it all spilled (NOTES.md).
Sweeps: a few matmuls per chunk, sequential over chunks, on grid (B, H, V / BLOCK_V), each
program looping over the N chunks with its fp32 slice of the state (K x BLOCK_V) in registers:
  forward: delta = U - W S;  o = scale (q alpha) S + Aqk delta;  S <- lam S + (k omega)^T delta
           (o and the final state; for the backward, the state entering every chunk instead).
  reverse: G <- lam G - W^T ((k omega) G) + Vc, with G = dL/d(state leaving the chunk) and
           Vc = scale (q alpha)^T do - W^T (Aqk^T do) batched beforehand (G of every chunk, d h0).
The backward's per-chunk gradients given the states (chunk_math.backward) run as batched XLA.
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
    (reverse sweep), then every chunk's gradients at once."""
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
    S_BHNKV, G_BHNKV = S_BHNKV[..., :K0, :V0], G_BHNKV[..., :K0, :V0]
    dots = _dots(dt)
    grads = chunked.vmap3(lambda *a: chunk.backward(*a[:9], a[10], a[11], a[9], scale, dots, pre=a[12]))
    dq, dk, dv, dg, dbeta, _ = grads(*chunks, S_BHNKV, G_BHNKV, p)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            dbeta.reshape(B, H, T), dh0_BHKV[:, :, :K0, :V0])
