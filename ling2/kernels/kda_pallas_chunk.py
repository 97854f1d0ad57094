"""Per-chunk KDA math shared by the Pallas TPU and GPU kernels (values already loaded, one head).

Same quantities as kda_chunked (see its docstring), written with 2-D arrays, iota masks and
matmuls only, so that Mosaic and Triton both lower it: q, k, g [C, K]; v, do [C, V]; beta and the
document facts as columns [C, 1] (doc also as a row [1, C]); the state S and its gradient G [K, V].
Sums of g over spans (the decay exponents) are matmuls of 0/1 iota matrices with g at full fp32
precision, which is exact up to fp32 summation; every exponent is <= 0.
  level l (s = 2^l): exponent e_l = sum of g over (pair boundary, i] for the bottom half's token i,
  over (j, pair boundary] for the top half's token j; the pair products
  (x * e^{e_l}) (y * e^{e_l})^T on the level's (bottom, top) blocks give sum_d x_i y_j e^{b_i-b_j}.
The unit lower-triangular inverse is built over the same levels: T <- T - T A_l T.
Precision: with fp32 inputs every matmul is fp32 (HIGHEST). With bf16 inputs, the matmuls that
touch data (state, values, outputs) take bf16 operands as fla does; the decay products and the
inverse take fp32 operands (HIGHEST on TPU, TF32 on GPU as fla's solve); the exponents are exact.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _dot(a, b, *, ta=False, tb=False, dt=jnp.float32, prec=_HI):
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), dims, precision=prec, preferred_element_type=jnp.float32)


class Dots:
    """The three matmul kinds for input dtype dt: exact (0/1 matrices, sums), mid (decays, inverse), data.
    mid_low: the precision of "mid" with bf16 inputs (Mosaic has only DEFAULT and HIGHEST)."""

    def __init__(self, dt, mid_low=_HI):
        low = dt != jnp.float32
        self.exact = lambda a, b, **kw: _dot(a, b, **kw)
        self.mid = lambda a, b, **kw: _dot(a, b, prec=mid_low if low else _HI, **kw)
        self.data = lambda a, b, **kw: _dot(a, b, dt=dt, prec=None if low else _HI, **kw)


def _iota(C, D=None):
    D = C if D is None else D
    return jax.lax.broadcasted_iota(jnp.int32, (C, D), 0), jax.lax.broadcasted_iota(jnp.int32, (C, D), 1)


def _f32(mask):
    return jnp.where(mask, 1.0, 0.0).astype(jnp.float32)


def level_mask(C, l):
    """[C, C] bool: i in the bottom half and j in the top half of the same level-l pair."""
    i, j = _iota(C)
    return (((i >> l) & 1) == 1) & (((j >> l) & 1) == 0) & ((i >> (l + 1)) == (j >> (l + 1)))


def level_exp(g, l, dots):
    """e^{exponent of level l} [C, K] (see the module docstring), each entry <= 1."""
    C = g.shape[0]
    t, u = _iota(C)
    same_half = (t >> l) == (u >> l)
    bottom = ((t >> l) & 1) == 1
    M = same_half & ((bottom & (u <= t)) | (~bottom & (u > t)))
    return jnp.exp(dots.exact(_f32(M), g))


def decays(g, first, last, V, dots):
    """alpha = e^{b} (first document), omega = e^{b_C - b} (last document), both [C, K], and the chunk decay
    lam = e^{b_C} broadcast over V as [K, V] (0 when the chunk holds a document start)."""
    C = g.shape[0]
    t, u = _iota(C)
    alpha = jnp.where(first > 0, jnp.exp(dots.exact(_f32(u <= t), g)), 0.0)
    omega = jnp.where(last > 0, jnp.exp(dots.exact(_f32(u > t), g)), 0.0)
    is_last = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    keep = jnp.sum(jnp.where(is_last, first, 0.0), axis=0, keepdims=True)  # [1, 1]
    lam = jnp.exp(dots.exact(g, jnp.ones((C, V), jnp.float32), ta=True)) * keep
    return alpha, omega, lam


def intra(q, k, g, beta, same, scale, dots):
    """Aqk (scaled, j <= i, same document), Akk0 (j < i, no beta) and T = (I + beta Akk0)^-1, all [C, C]."""
    C = q.shape[0]
    i, j = _iota(C)
    eye = i == j
    qk = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=1, keepdims=True)
    Aqk = jnp.where(eye, scale * qk, 0.0)
    Akk0 = jnp.zeros((C, C), jnp.float32)
    T = _f32(eye)
    for l in range(C.bit_length() - 1):
        e = level_exp(g, l, dots)
        qe, ke = q * e, k * e
        m = level_mask(C, l) & same
        Aqk += jnp.where(m, scale * dots.mid(qe, ke, tb=True), 0.0)
        A = jnp.where(m, dots.mid(ke, ke, tb=True), 0.0)
        Akk0 += A
        T = T - dots.mid(dots.mid(T, beta * A), T)
    return Aqk, Akk0, T


def _prologue(q, k, v, g, beta, doc_col, doc_row, first, last, scale, dots):
    same = doc_col == doc_row
    Aqk, Akk0, T = intra(q, k, g, beta, same, scale, dots)
    alpha, omega, lam = decays(g, first, last, v.shape[1], dots)
    U = dots.data(T, beta * v)
    W = dots.data(T, beta * k * alpha)
    return same, Aqk, Akk0, T, alpha, omega, lam, U, W


def forward(q, k, v, g, beta, doc_col, doc_row, first, last, S, scale, dots):
    """One chunk: (o [C, V] fp32, state leaving the chunk [K, V] fp32)."""
    _, Aqk, _, _, alpha, omega, lam, U, W = _prologue(q, k, v, g, beta, doc_col, doc_row, first, last, scale, dots)
    delta = U - dots.data(W, S)
    o = scale * dots.data(q * alpha, S) + dots.data(Aqk, delta)
    return o, lam * S + dots.data(k * omega, delta, ta=True)


def backward(q, k, v, g, beta, doc_col, doc_row, first, last, S, G, do, scale, dots):
    """One chunk, given the state entering it (S) and dL/d(state leaving it) (G): dq, dk [C, K], dv [C, V],
    dg [C, K], dbeta [C, 1] and dL/d(state entering it) [K, V], all fp32."""
    C = q.shape[0]
    same, Aqk, Akk0, T, alpha, omega, lam, U, W = _prologue(q, k, v, g, beta, doc_col, doc_row, first, last, scale,
                                                            dots)
    q, k, v, do = (x.astype(jnp.float32) for x in (q, k, v, do))
    i, j = _iota(C)
    delta = U - dots.data(W, S)
    qa, ka, kw = q * alpha, k * alpha, k * omega
    ddelta = dots.data(Aqk, do, ta=True) + dots.data(kw, G)
    dAqk = jnp.where((i >= j) & same, scale * dots.data(do, delta, tb=True), 0.0)
    dqa = scale * dots.data(do, S, tb=True)
    dkw = dots.data(delta, G, tb=True)
    dr = dots.data(T, ddelta, ta=True)
    dAkk = jnp.where((i > j) & same, -dots.data(dr, delta, tb=True), 0.0)
    rv = v - dots.data(ka, S)
    dbeta = jnp.sum(dr * rv, axis=1, keepdims=True) + jnp.sum(dAkk * Akk0, axis=1, keepdims=True)
    drb = beta * dr
    dka = -dots.data(drb, S, tb=True)
    dAkk = beta * dAkk  # [C, C]: cotangent of the beta-free pair products
    diag = jnp.sum(jnp.where(i == j, dAqk, 0.0), axis=1, keepdims=True)
    dq = diag * k + alpha * dqa
    dk = diag * q + alpha * dka + omega * dkw
    db = qa * dqa + ka * dka - kw * dkw
    for l in range(C.bit_length() - 1):
        e = level_exp(g, l, dots)
        qe, ke = q * e, k * e
        m = level_mask(C, l)
        Dq, Dk = jnp.where(m, dAqk, 0.0), jnp.where(m, dAkk, 0.0)
        dq_l = e * dots.mid(Dq, ke)
        dk_row = e * dots.mid(Dk, ke)
        dk_col = e * (dots.mid(Dq, qe, ta=True) + dots.mid(Dk, ke, ta=True))
        dq += dq_l
        dk += dk_row + dk_col
        db += q * dq_l + k * dk_row - k * dk_col
    t, u = _iota(C)
    ones_cv = jnp.ones((C, G.shape[1]), jnp.float32)
    # dg_t = sum_{i >= t} db_i, where db_C also gets sum_j kw_j dkw_j and lam * sum_v S G.
    dg = (dots.exact(_f32(u >= t), db) + dots.exact(jnp.ones((C, C), jnp.float32), kw * dkw)
          + dots.exact(ones_cv, lam * S * G, tb=True))
    G_in = lam * G + dots.data(qa, do, ta=True) * scale - dots.data(ka, drb, ta=True)
    return dq, dk, drb, dg, dbeta, G_in
