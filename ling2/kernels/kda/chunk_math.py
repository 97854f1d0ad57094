"""Per-chunk KDA math, one head, shared by the pure-JAX chunked form (vmapped over batch, heads and
chunks) and by the Pallas TPU and GPU kernels (values already loaded into the kernel).

Shapes: q, k, g [C, K]; v, do [C, V]; beta and the document facts as columns [C, 1] (doc also as a
row [1, C]); the state S and its gradient G [K, V]. Only 2-D arrays, iota masks and matmuls, so
Mosaic and Triton both lower it. C is a power of two.

Chunk quantities (b_i = sum_{t<=i} g_t within the chunk, per key dim; masks keep j <= i and the
same document; alpha = e^{b} on the document of the state entering the chunk, omega = e^{b_C-b}
on the document reaching the state leaving it, lam = e^{b_C} if the chunk has no document start):
  Akk0[i,j] = sum_d k_i k_j e^{b_i-b_j} (j < i),  Aqk[i,j] = scale sum_d q_i k_j e^{b_i-b_j} (j <= i)
  T = (I + diag(beta) Akk0)^-1,  U = T diag(beta) v,  W = T diag(beta) (k alpha)
  delta = U - W S,  o = scale (q alpha) S + Aqk delta,  S' = diag(lam) S + (k omega)^T delta
(delta_j = beta_j (v_j - k_j S_j-), with S_j- the decayed state before token j's update.)

Per-key-dim decays cannot be split as e^{b_i} e^{-b_j} (e^{-b_j} overflows under strong gates).
Level l (s = 2^l) cuts the chunk into pairs of s-token halves; on the (bottom half i, top half j)
block of each pair, e^{b_i-b_j} = e^{sum of g over (boundary, i]} e^{sum of g over (j, boundary]},
both factors <= 1, so the block is a masked product (x e^{E_l}) (y e^{E_l})^T. Levels 0 .. log2(C)-1
cover the strict lower triangle once, and the same levels invert I + A exactly by the block formula
(T <- T - T A_l T, as fla merges its sub-chunk inverses). The exponents E_l and all span sums of g
are matmuls of 0/1 iota matrices with g at full precision (an fp32 sum; every exponent <= 0).

Backward: the gate gradient comes from the identity dL/db = x . dx - y . dy of every
x_i y_j e^{b_i - b_j} term, and dg is the reverse cumulative sum of dL/db within the chunk.

Precision: with fp32 (fp64) inputs every matmul is fp32 (fp64) at HIGHEST. With bf16 inputs, the
matmuls that touch data (state, values, outputs) take bf16 operands as fla does; the decay products
and the inverse take fp32 operands (HIGHEST on TPU, TF32 on GPU as fla's solve); exponents are exact.

Axes in names: C chunk tokens (both axes of a [C, C] pair matrix), K key dim, V value dim, 1 a
kept singleton axis. The math's own T (the inverse) is `T_CC`.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


class Dots:
    """Matmuls with fp32 (or fp64) accumulation for input dtype dt, in three kinds: exact (0/1 matrices,
    sums), mid (decay products, inverse) and data. mid_low is mid's precision with bf16 inputs."""

    def __init__(self, dt, mid_low=_HI):
        self.acc = jnp.promote_types(dt, jnp.float32)
        low = self.acc == jnp.float32 and dt != jnp.float32
        self.exact = lambda a, b, **kw: self._dot(a, b, self.acc, _HI, **kw)
        self.mid = lambda a, b, **kw: self._dot(a, b, self.acc, mid_low if low else _HI, **kw)
        self.data = lambda a, b, **kw: self._dot(a, b, dt if low else self.acc, None if low else _HI, **kw)

    def _dot(self, a, b, dt, prec, ta=False, tb=False):
        dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
        return jax.lax.dot_general(a.astype(dt), b.astype(dt), dims, precision=prec, preferred_element_type=self.acc)

    def ones(self, shape):
        return jnp.ones(shape, self.acc)

    def mask(self, m):
        return jnp.where(m, 1.0, 0.0).astype(self.acc)


def _iota(C):
    return jax.lax.broadcasted_iota(jnp.int32, (C, C), 0), jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)


def levels(C):
    return range(C.bit_length() - 1)


def level_mask(C, l):
    """[C, C] bool: i in the bottom half and j in the top half of the same level-l pair."""
    i, j = _iota(C)
    return (((i >> l) & 1) == 1) & (((j >> l) & 1) == 0) & ((i >> (l + 1)) == (j >> (l + 1)))


def level_exp(g_CK, l, dots):
    """e^{E_l} [C, K]: E_l = sum of g over (pair boundary, i] for a bottom-half token i and over (i, pair
    boundary] for a top-half token; every entry <= 1."""
    t, u = _iota(g_CK.shape[0])
    bottom_CC = ((t >> l) & 1) == 1
    M_CC = ((t >> l) == (u >> l)) & ((bottom_CC & (u <= t)) | (~bottom_CC & (u > t)))
    return jnp.exp(dots.exact(dots.mask(M_CC), g_CK))


def decays(g_CK, first_C1, last_C1, V, dots):
    """alpha = e^{b}, omega = e^{b_C - b} (both [C, K], masked to their documents) and lam = e^{b_C}
    broadcast over V as [K, V] (0 when the chunk holds a document start)."""
    C = g_CK.shape[0]
    t, u = _iota(C)
    alpha_CK = jnp.where(first_C1 > 0, jnp.exp(dots.exact(dots.mask(u <= t), g_CK)), 0.0)
    omega_CK = jnp.where(last_C1 > 0, jnp.exp(dots.exact(dots.mask(u > t), g_CK)), 0.0)
    is_last_C1 = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    keep_11 = jnp.sum(jnp.where(is_last_C1, first_C1, 0.0), axis=0, keepdims=True)
    lam_KV = jnp.exp(dots.exact(g_CK, dots.ones((C, V)), ta=True)) * keep_11
    return alpha_CK, omega_CK, lam_KV


def intra(q_CK, k_CK, g_CK, beta_C1, same_CC, scale, dots):
    """Aqk (scaled, j <= i), Akk0 (j < i, without beta), both masked to the same document, and
    T = (I + diag(beta) Akk0)^-1, all [C, C]."""
    C = q_CK.shape[0]
    i, j = _iota(C)
    qk_C1 = jnp.sum(q_CK.astype(dots.acc) * k_CK.astype(dots.acc), axis=1, keepdims=True)
    Aqk_CC = jnp.where(i == j, scale * qk_C1, 0.0)
    zero_CC = jnp.zeros_like(Aqk_CC)  # (like q: under shard_map the loop carries vary as q does)
    T_CC = jnp.where(i == j, 1.0, zero_CC)

    def level(l, carry):
        Aqk_CC, Akk0_CC, T_CC = carry
        e_CK = level_exp(g_CK, l, dots)
        qe_CK, ke_CK = q_CK * e_CK, k_CK * e_CK
        m_CC = level_mask(C, l) & same_CC
        A_CC = jnp.where(m_CC, dots.mid(ke_CK, ke_CK, tb=True), 0.0)
        T_CC = T_CC - dots.mid(dots.mid(T_CC, beta_C1 * A_CC), T_CC)
        return Aqk_CC + jnp.where(m_CC, scale * dots.mid(qe_CK, ke_CK, tb=True), 0.0), Akk0_CC + A_CC, T_CC

    Aqk_CC, Akk0_CC, T_CC = jax.lax.fori_loop(0, len(levels(C)), level, (Aqk_CC, zero_CC, T_CC))
    return Aqk_CC, Akk0_CC, T_CC


def prologue(q_CK, k_CK, v_CV, g_CK, beta_C1, doc_C1, doc_1C, first_C1, last_C1, scale, dots):
    """Everything of a chunk that does not need the state: a dict of same, Aqk, Akk0, T, alpha, omega, lam, U, W."""
    same_CC = doc_C1 == doc_1C
    Aqk_CC, Akk0_CC, T_CC = intra(q_CK, k_CK, g_CK, beta_C1, same_CC, scale, dots)
    alpha_CK, omega_CK, lam_KV = decays(g_CK, first_C1, last_C1, v_CV.shape[1], dots)
    U_CV = dots.data(T_CC, beta_C1 * v_CV)
    W_CK = dots.data(T_CC, beta_C1 * k_CK * alpha_CK)
    return dict(same=same_CC, Aqk=Aqk_CC, Akk0=Akk0_CC, T=T_CC, alpha=alpha_CK, omega=omega_CK, lam=lam_KV, U=U_CV,
                W=W_CK)


def state_step(S_KV, kw_CK, U_CV, W_CK, lam_KV, dots):
    """(delta [C, V], state leaving the chunk [K, V]) from the state entering it; kw = k * omega."""
    delta_CV = U_CV - dots.data(W_CK, S_KV)
    return delta_CV, lam_KV * S_KV + dots.data(kw_CK, delta_CV, ta=True)


def output(q_CK, alpha_CK, Aqk_CC, S_KV, delta_CV, scale, dots):
    """o [C, V] from the state entering the chunk and delta."""
    return scale * dots.data(q_CK * alpha_CK, S_KV) + dots.data(Aqk_CC, delta_CV)


def forward(q_CK, k_CK, v_CV, g_CK, beta_C1, doc_C1, doc_1C, first_C1, last_C1, S_KV, scale, dots):
    """One chunk: (o [C, V], state leaving the chunk [K, V]), in the accumulation dtype."""
    p = prologue(q_CK, k_CK, v_CV, g_CK, beta_C1, doc_C1, doc_1C, first_C1, last_C1, scale, dots)
    delta_CV, S_out_KV = state_step(S_KV, k_CK * p["omega"], p["U"], p["W"], p["lam"], dots)
    return output(q_CK, p["alpha"], p["Aqk"], S_KV, delta_CV, scale, dots), S_out_KV


def backward(q_CK, k_CK, v_CV, g_CK, beta_C1, doc_C1, doc_1C, first_C1, last_C1, S_KV, G_KV, do_CV, scale, dots,
             pre=None):
    """One chunk, given the state entering it (S) and dL/d(state leaving it) (G): dq, dk [C, K], dv [C, V],
    dg [C, K], dbeta [C, 1] and dL/d(state entering it) [K, V]. pre: this chunk's prologue if already computed."""
    C = q_CK.shape[0]
    p = (prologue(q_CK, k_CK, v_CV, g_CK, beta_C1, doc_C1, doc_1C, first_C1, last_C1, scale, dots) if pre is None
         else pre)
    same_CC, Aqk_CC, Akk0_CC, T_CC, alpha_CK, omega_CK, lam_KV = (
        p[n] for n in ("same", "Aqk", "Akk0", "T", "alpha", "omega", "lam"))
    q_CK, k_CK, v_CV, do_CV = (x.astype(dots.acc) for x in (q_CK, k_CK, v_CV, do_CV))
    i, j = _iota(C)
    qa_CK, ka_CK, kw_CK = q_CK * alpha_CK, k_CK * alpha_CK, k_CK * omega_CK
    delta_CV = p["U"] - dots.data(p["W"], S_KV)
    ddelta_CV = dots.data(Aqk_CC, do_CV, ta=True) + dots.data(kw_CK, G_KV)
    dAqk_CC = jnp.where((i >= j) & same_CC, scale * dots.data(do_CV, delta_CV, tb=True), 0.0)
    dqa_CK = scale * dots.data(do_CV, S_KV, tb=True)
    dkw_CK = dots.data(delta_CV, G_KV, tb=True)
    dr_CV = dots.data(T_CC, ddelta_CV, ta=True)
    dAkk_CC = jnp.where((i > j) & same_CC, -dots.data(dr_CV, delta_CV, tb=True), 0.0)
    rv_CV = v_CV - dots.data(ka_CK, S_KV)
    dbeta_C1 = jnp.sum(dr_CV * rv_CV, axis=1, keepdims=True) + jnp.sum(dAkk_CC * Akk0_CC, axis=1, keepdims=True)
    drb_CV = beta_C1 * dr_CV
    dka_CK = -dots.data(drb_CV, S_KV, tb=True)
    dAkk_CC = beta_C1 * dAkk_CC  # cotangent of the beta-free pair products
    diag_C1 = jnp.sum(jnp.where(i == j, dAqk_CC, 0.0), axis=1, keepdims=True)
    dq_CK = diag_C1 * k_CK + alpha_CK * dqa_CK
    dk_CK = diag_C1 * q_CK + alpha_CK * dka_CK + omega_CK * dkw_CK
    db_CK = qa_CK * dqa_CK + ka_CK * dka_CK - kw_CK * dkw_CK

    def level(l, carry):
        dq_CK, dk_CK, db_CK = carry
        e_CK = level_exp(g_CK, l, dots)
        qe_CK, ke_CK = q_CK * e_CK, k_CK * e_CK
        m_CC = level_mask(C, l)
        Dq_CC, Dk_CC = jnp.where(m_CC, dAqk_CC, 0.0), jnp.where(m_CC, dAkk_CC, 0.0)
        dq_l_CK = e_CK * dots.mid(Dq_CC, ke_CK)
        dk_row_CK = e_CK * dots.mid(Dk_CC, ke_CK)
        dk_col_CK = e_CK * (dots.mid(Dq_CC, qe_CK, ta=True) + dots.mid(Dk_CC, ke_CK, ta=True))
        return (dq_CK + dq_l_CK, dk_CK + dk_row_CK + dk_col_CK,
                db_CK + q_CK * dq_l_CK + k_CK * dk_row_CK - k_CK * dk_col_CK)

    dq_CK, dk_CK, db_CK = jax.lax.fori_loop(0, len(levels(C)), level, (dq_CK, dk_CK, db_CK))
    t, u = _iota(C)
    # dg_t = sum_{i >= t} db_i, where db at the last token also gets sum_j kw_j dkw_j and lam * sum_v S G.
    dg_CK = (dots.exact(dots.mask(u >= t), db_CK) + dots.exact(dots.ones((C, C)), kw_CK * dkw_CK)
             + dots.exact(dots.ones((C, G_KV.shape[1])), lam_KV * S_KV * G_KV, tb=True))
    G_in_KV = lam_KV * G_KV + scale * dots.data(qa_CK, do_CV, ta=True) - dots.data(ka_CK, drb_CV, ta=True)
    return dq_CK, dk_CK, drb_CV, dg_CK, dbeta_C1, G_in_KV
