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


def level_exp(g, l, dots):
    """e^{E_l} [C, K]: E_l = sum of g over (pair boundary, i] for a bottom-half token i and over (i, pair
    boundary] for a top-half token; every entry <= 1."""
    t, u = _iota(g.shape[0])
    bottom = ((t >> l) & 1) == 1
    M = ((t >> l) == (u >> l)) & ((bottom & (u <= t)) | (~bottom & (u > t)))
    return jnp.exp(dots.exact(dots.mask(M), g))


def decays(g, first, last, V, dots):
    """alpha = e^{b}, omega = e^{b_C - b} (both [C, K], masked to their documents) and lam = e^{b_C}
    broadcast over V as [K, V] (0 when the chunk holds a document start)."""
    C = g.shape[0]
    t, u = _iota(C)
    alpha = jnp.where(first > 0, jnp.exp(dots.exact(dots.mask(u <= t), g)), 0.0)
    omega = jnp.where(last > 0, jnp.exp(dots.exact(dots.mask(u > t), g)), 0.0)
    is_last = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    keep = jnp.sum(jnp.where(is_last, first, 0.0), axis=0, keepdims=True)  # [1, 1]
    lam = jnp.exp(dots.exact(g, dots.ones((C, V)), ta=True)) * keep
    return alpha, omega, lam


def intra(q, k, g, beta, same, scale, dots):
    """Aqk (scaled, j <= i), Akk0 (j < i, without beta), both masked to the same document, and
    T = (I + diag(beta) Akk0)^-1, all [C, C]."""
    C = q.shape[0]
    i, j = _iota(C)
    qk = jnp.sum(q.astype(dots.acc) * k.astype(dots.acc), axis=1, keepdims=True)
    Aqk = jnp.where(i == j, scale * qk, 0.0)
    zero = jnp.zeros_like(Aqk)  # (like q: under shard_map the loop carries vary as q does)
    T = jnp.where(i == j, 1.0, zero)

    def level(l, carry):
        Aqk, Akk0, T = carry
        e = level_exp(g, l, dots)
        qe, ke = q * e, k * e
        m = level_mask(C, l) & same
        A = jnp.where(m, dots.mid(ke, ke, tb=True), 0.0)
        T = T - dots.mid(dots.mid(T, beta * A), T)
        return Aqk + jnp.where(m, scale * dots.mid(qe, ke, tb=True), 0.0), Akk0 + A, T

    Aqk, Akk0, T = jax.lax.fori_loop(0, len(levels(C)), level, (Aqk, zero, T))
    return Aqk, Akk0, T


def prologue(q, k, v, g, beta, doc_col, doc_row, first, last, scale, dots):
    """Everything of a chunk that does not need the state: a dict of same, Aqk, Akk0, T, alpha, omega, lam, U, W."""
    same = doc_col == doc_row
    Aqk, Akk0, T = intra(q, k, g, beta, same, scale, dots)
    alpha, omega, lam = decays(g, first, last, v.shape[1], dots)
    U = dots.data(T, beta * v)
    W = dots.data(T, beta * k * alpha)
    return dict(same=same, Aqk=Aqk, Akk0=Akk0, T=T, alpha=alpha, omega=omega, lam=lam, U=U, W=W)


def state_step(S, kw, U, W, lam, dots):
    """(delta [C, V], state leaving the chunk [K, V]) from the state entering it; kw = k * omega."""
    delta = U - dots.data(W, S)
    return delta, lam * S + dots.data(kw, delta, ta=True)


def output(q, alpha, Aqk, S, delta, scale, dots):
    """o [C, V] from the state entering the chunk and delta."""
    return scale * dots.data(q * alpha, S) + dots.data(Aqk, delta)


def forward(q, k, v, g, beta, doc_col, doc_row, first, last, S, scale, dots):
    """One chunk: (o [C, V], state leaving the chunk [K, V]), in the accumulation dtype."""
    p = prologue(q, k, v, g, beta, doc_col, doc_row, first, last, scale, dots)
    delta, S_out = state_step(S, k * p["omega"], p["U"], p["W"], p["lam"], dots)
    return output(q, p["alpha"], p["Aqk"], S, delta, scale, dots), S_out


def backward(q, k, v, g, beta, doc_col, doc_row, first, last, S, G, do, scale, dots, pre=None):
    """One chunk, given the state entering it (S) and dL/d(state leaving it) (G): dq, dk [C, K], dv [C, V],
    dg [C, K], dbeta [C, 1] and dL/d(state entering it) [K, V]. pre: this chunk's prologue if already computed."""
    C = q.shape[0]
    p = prologue(q, k, v, g, beta, doc_col, doc_row, first, last, scale, dots) if pre is None else pre
    same, Aqk, Akk0, T, alpha, omega, lam = (p[n] for n in ("same", "Aqk", "Akk0", "T", "alpha", "omega", "lam"))
    q, k, v, do = (x.astype(dots.acc) for x in (q, k, v, do))
    i, j = _iota(C)
    qa, ka, kw = q * alpha, k * alpha, k * omega
    delta = p["U"] - dots.data(p["W"], S)
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
    dAkk = beta * dAkk  # cotangent of the beta-free pair products
    diag = jnp.sum(jnp.where(i == j, dAqk, 0.0), axis=1, keepdims=True)
    dq = diag * k + alpha * dqa
    dk = diag * q + alpha * dka + omega * dkw
    db = qa * dqa + ka * dka - kw * dkw

    def level(l, carry):
        dq, dk, db = carry
        e = level_exp(g, l, dots)
        qe, ke = q * e, k * e
        m = level_mask(C, l)
        Dq, Dk = jnp.where(m, dAqk, 0.0), jnp.where(m, dAkk, 0.0)
        dq_l = e * dots.mid(Dq, ke)
        dk_row = e * dots.mid(Dk, ke)
        dk_col = e * (dots.mid(Dq, qe, ta=True) + dots.mid(Dk, ke, ta=True))
        return dq + dq_l, dk + dk_row + dk_col, db + q * dq_l + k * dk_row - k * dk_col

    dq, dk, db = jax.lax.fori_loop(0, len(levels(C)), level, (dq, dk, db))
    t, u = _iota(C)
    # dg_t = sum_{i >= t} db_i, where db at the last token also gets sum_j kw_j dkw_j and lam * sum_v S G.
    dg = (dots.exact(dots.mask(u >= t), db) + dots.exact(dots.ones((C, C)), kw * dkw)
          + dots.exact(dots.ones((C, G.shape[1])), lam * S * G, tb=True))
    G_in = lam * G + scale * dots.data(qa, do, ta=True) - dots.data(ka, drb, ta=True)
    return dq, dk, drb, dg, dbeta, G_in
