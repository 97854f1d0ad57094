"""Chunked Kimi Delta Attention in pure JAX (the WY / UT-transform form of fla's `chunk_kda`).

Works on the prepared layout of `kda.prepare` (time padded to N*C, heads before time):
  q, k, g [B, H, T, K]; v, do [B, H, T, V]; beta [B, H, T]; aux (`kda.prepare_docs`):
  doc [B, 1, T] document index, first / last [B, 1, T] bool (token shares the document of the
  state entering / leaving its chunk). Everything is computed in the accumulation dtype (fp32,
  fp64 for fp64 inputs).

One chunk, one head (b_i = sum_{t<=i} g_t within the chunk, per key dim):
  Akk[i,j] = beta_i sum_d k_i k_j e^{b_i-b_j} (j < i),  Aqk[i,j] = scale sum_d q_i k_j e^{b_i-b_j} (j <= i)
  T = (I + Akk)^-1,  U = T diag(beta) v,  W = T diag(beta) (k * e^{b})
  delta = U - W S,  o = scale (q * e^{b}) S + Aqk delta,  S' = diag(e^{b_C}) S + (k * e^{b_C-b})^T delta
(delta_j is beta_j (v_j - k_j S_j-) with S_j- the decayed state before token j's update.)

Per-key-dim decays cannot be split as e^{b_i} e^{-b_j} (e^{-b_j} overflows under strong gates),
so the pair products are built level by level: at level s the chunk is cut into pairs of
s-token halves, and the block (bottom half i, top half j) of each pair factors through the
pair's boundary as (x_i e^{sum g over the bottom half up to i}) . (y_j e^{sum g after j in the
top half}), both factors <= 1. Levels s = 1, 2, ..., C/2 cover the strict lower triangle once.
The same recursion inverts I + Akk exactly (block formula T10 = -T11 A10 T00). C must be a
power of two.

The backward recomputes chunk states (a forward scan), sweeps the state gradient backwards
and gets the gate gradient from the identity dL/db = x . dx - y . dy of every x_i y_j e^{b_i-b_j}
term; dg is the reverse cumulative sum of dL/db within the chunk.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def levels(C):
    """Pair half-sizes 1, 2, ..., C/2 (bottom-up)."""
    return [1 << i for i in range(C.bit_length() - 1)]


def _chunks(x, C):
    B, H, T = x.shape[:3]
    return x.reshape(B, H, T // C, C, *x.shape[3:])


def _ein(spec, *xs):
    return jnp.einsum(spec, *xs, precision=_HI)


def _pairs(x, s):
    """[..., C, D] -> (top, bottom) halves of each pair, each [..., C/2s, s, D]."""
    *lead, C, D = x.shape
    x = x.reshape(*lead, C // (2 * s), 2, s, D)
    return x[..., 0, :, :], x[..., 1, :, :]


def _unpairs(top, bot):
    x = jnp.stack([top, bot], axis=-3)
    return x.reshape(*x.shape[:-4], -1, x.shape[-1])


def rev_excl_cumsum(x, axis=-2):
    """y_i = sum_{j > i} x_j along axis (no subtraction, so no cancellation)."""
    rev = jnp.flip(jnp.cumsum(jnp.flip(x, axis), axis), axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, 1)
    return jnp.pad(jax.lax.slice_in_dim(rev, 1, None, axis=axis), pad)


def level_decays(g, s):
    """Level-s factors, each [..., C/2s, s, K] and <= 1: e_top[j] = e^{sum of g after j in its top half},
    e_bot[i] = e^{sum of g from its bottom half's start to i}; e_bot[i] e_top[j] = e^{b_i - b_j}."""
    top, bot = _pairs(g, s)
    return jnp.exp(rev_excl_cumsum(top)), jnp.exp(jnp.cumsum(bot, axis=-2))


def _build(diag, lower, C):
    """Bottom-up block recursion: from 1 x 1 diagonal blocks [..., C] to [..., C, C]. At level s,
    lower(s, top, bot) gives each pair's lower-left block from its two diagonal blocks [..., C/2s, s, s]."""
    D = diag[..., None, None]
    for s in levels(C):
        D = D.reshape(*D.shape[:-3], -1, 2, s, s)
        top, bot = D[..., 0, :, :], D[..., 1, :, :]
        upper = jnp.concatenate([top, jnp.zeros_like(top)], axis=-1)
        D = jnp.concatenate([upper, jnp.concatenate([lower(s, top, bot), bot], axis=-1)], axis=-2)
    return D[..., 0, :, :]


def _split(M, C):
    """Inverse of _build for a lower-triangular [..., C, C]: (diagonal [..., C], {s: lower-left blocks})."""
    D, blocks = M[..., None, :, :], {}
    for s in reversed(levels(C)):
        blocks[s] = D[..., s:, :s]
        D = jnp.stack([D[..., :s, :s], D[..., s:, s:]], axis=-3)
        D = D.reshape(*D.shape[:-4], -1, s, s)
    return D[..., 0, 0], blocks


def decay_products(xs, y, g, C):
    """For each x in xs, the level blocks of sum_d x_i[d] y_j[d] e^{b_i[d] - b_j[d]} (i > j): [{s: [..., C/2s, s, s]}]."""
    out = [{} for _ in xs]
    for s in levels(C):
        e_top, e_bot = level_decays(g, s)
        yt = _pairs(y, s)[0] * e_top
        for blocks, x in zip(out, xs):
            blocks[s] = _ein("...pik,...pjk->...pij", _pairs(x, s)[1] * e_bot, yt)
    return out


def decay_products_vjp(dblocks, xs, y, g, C):
    """Cotangents of decay_products: ([dx for each x], dy), each [..., C, K]."""
    dxs, dy = [0.0] * len(xs), 0.0
    for s in levels(C):
        e_top, e_bot = level_decays(g, s)
        yt = _pairs(y, s)[0] * e_top
        dyt = 0.0
        for n, x in enumerate(xs):
            xb = _pairs(x, s)[1] * e_bot
            dxb = _ein("...pij,...pjk->...pik", dblocks[n][s], yt) * e_bot
            dyt += _ein("...pij,...pik->...pjk", dblocks[n][s], xb)
            dxs[n] += _unpairs(jnp.zeros_like(dxb), dxb)
        dyt = dyt * e_top
        dy += _unpairs(dyt, jnp.zeros_like(dyt))
    return dxs, dy


def unit_lower_inverse(A, C):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], by the block formula level by level."""
    _, blocks = _split(A, C)
    lower = lambda s, top, bot: -_ein("...pij,...pjk->...pik", _ein("...pij,...pjk->...pik", bot, blocks[s]), top)
    return _build(jnp.ones(A.shape[:-1], A.dtype), lower, C)


def _intra(q, k, g, beta, aux, scale, C):
    """Per-chunk quantities that need no state: masked Aqk (scaled, j <= i), Akk0 (no beta, j < i),
    T = (I + beta Akk0)^-1 and the decays alpha = e^{b}, omega = e^{b_C - b} [.., C, K], lam = e^{b_C} [.., K]."""
    qc, kc, gc = _chunks(q, C), _chunks(k, C), _chunks(g, C)
    doc = _chunks(aux["doc"], C)
    same = doc[..., :, None] == doc[..., None, :]  # [B, 1, N, C, C]
    bq, bk = decay_products([qc, kc], kc, gc, C)
    Aqk = _build(scale * jnp.sum(qc * kc, -1), lambda s, t, b: scale * bq[s], C) * same
    Akk0 = _build(jnp.zeros(qc.shape[:-1], qc.dtype), lambda s, t, b: bk[s], C) * same
    T = unit_lower_inverse(_chunks(beta, C)[..., :, None] * Akk0, C)
    first, last = _chunks(aux["first"], C)[..., None], _chunks(aux["last"], C)[..., None]
    alpha = jnp.where(first, jnp.exp(jnp.cumsum(gc, axis=-2)), 0.0)
    omega = jnp.where(last, jnp.exp(rev_excl_cumsum(gc)), 0.0)
    lam = jnp.where(first[..., -1, :], jnp.exp(jnp.sum(gc, axis=-2)), 0.0)
    return dict(Aqk=Aqk, Akk0=Akk0, T=T, alpha=alpha, omega=omega, lam=lam, same=same)


def _wy(f, k, v, beta, C):
    """U = T diag(beta) v and W = T diag(beta) (k * alpha), [B, H, N, C, V] and [.., C, K]."""
    bc = _chunks(beta, C)[..., None]
    U = _ein("...ij,...jv->...iv", f["T"], bc * _chunks(v, C))
    W = _ein("...ij,...jk->...ik", f["T"], bc * _chunks(k, C) * f["alpha"])
    return U, W


def _states(kw, U, W, lam, h0):
    """States entering each chunk [B, H, N, K, V] and the final state [B, H, K, V]."""
    lead = lambda x: jnp.moveaxis(x, 2, 0)

    def step(S, xs):
        kw_c, U_c, W_c, lam_c = xs
        delta = U_c - _ein("bhck,bhkv->bhcv", W_c, S)
        return lam_c[..., None] * S + _ein("bhck,bhcv->bhkv", kw_c, delta), S

    hT, S_in = jax.lax.scan(step, h0, (lead(kw), lead(U), lead(W), lead(lam)))
    return jnp.moveaxis(S_in, 0, 2), hT


def forward(q, k, v, g, beta, aux, h0, scale, C):
    """Returns o [B, H, T, V] and the final state [B, H, K, V], in the accumulation dtype."""
    acc = h0.dtype
    q, k, v = (x.astype(acc) for x in (q, k, v))
    f = _intra(q, k, g, beta, aux, scale, C)
    U, W = _wy(f, k, v, beta, C)
    kw = _chunks(k, C) * f["omega"]
    S, hT = _states(kw, U, W, f["lam"], h0)
    delta = U - _ein("...ck,...kv->...cv", W, S)
    o = scale * _ein("...ck,...kv->...cv", _chunks(q, C) * f["alpha"], S) + _ein("...ij,...jv->...iv", f["Aqk"], delta)
    return o.reshape(v.shape), hT


def backward(q, k, v, g, beta, aux, h0, do, dhT, scale, C):
    """Returns dq, dk, dv, dg (layout of q, k, v, g), dbeta [B, H, T] and d h0, in the accumulation dtype."""
    acc = h0.dtype
    q, k, v, do = (x.astype(acc) for x in (q, k, v, do))
    f = _intra(q, k, g, beta, aux, scale, C)
    U, W = _wy(f, k, v, beta, C)
    qc, kc, vc, gc, doc_ = _chunks(q, C), _chunks(k, C), _chunks(v, C), _chunks(g, C), _chunks(do, C)
    bc = _chunks(beta, C)
    alpha, omega, lam, Aqk, Akk0, T = (f[n] for n in ("alpha", "omega", "lam", "Aqk", "Akk0", "T"))
    kw, qa, ka = kc * omega, qc * alpha, kc * alpha
    S, _ = _states(kw, U, W, lam, h0)
    delta = U - _ein("...ck,...kv->...cv", W, S)

    # Reverse sweep: G = dL/d(state leaving chunk c); G_in = lam G + Vc - W^T (kw G).
    AtdO = _ein("...ij,...iv->...jv", Aqk, doc_)
    Vc = scale * _ein("...ck,...cv->...kv", qa, doc_) - _ein("...ck,...cv->...kv", W, AtdO)
    lead = lambda x: jnp.moveaxis(x, 2, 0)

    def step(G, xs):
        kw_c, W_c, lam_c, V_c = xs
        G_in = lam_c[..., None] * G - _ein("bhck,bhcv->bhkv", W_c, _ein("bhck,bhkv->bhcv", kw_c, G)) + V_c
        return G_in, G

    dh0, Gn = jax.lax.scan(step, dhT.astype(acc), (lead(kw), lead(W), lead(lam), lead(Vc)), reverse=True)
    Gn = jnp.moveaxis(Gn, 0, 2)  # [B, H, N, K, V]

    ddelta = AtdO + _ein("...ck,...kv->...cv", kw, Gn)
    dAqk = _ein("...iv,...jv->...ij", doc_, delta) * f["same"]
    dqa = scale * _ein("...iv,...kv->...ik", doc_, S)
    dkw = _ein("...cv,...kv->...ck", delta, Gn)
    dlam = jnp.sum(S * Gn, axis=-1)
    dr = _ein("...ij,...iv->...jv", T, ddelta)  # T^T ddelta
    dAkk = -_ein("...iv,...jv->...ij", dr, delta) * f["same"]
    rv = vc - _ein("...ck,...kv->...cv", ka, S)
    dbeta = jnp.sum(dr * rv, axis=-1) + jnp.sum(dAkk * Akk0, axis=-1)
    drb = bc[..., None] * dr
    dka = -_ein("...cv,...kv->...ck", drb, S)

    dqk_diag, dqk_blocks = _split(scale * dAqk, C)
    _, dkk_blocks = _split(bc[..., :, None] * dAkk, C)
    (dq_g, dk_row), dk_col = decay_products_vjp([dqk_blocks, dkk_blocks], [qc, kc], kc, gc, C)
    dq = dq_g + dqk_diag[..., None] * kc + alpha * dqa
    dk = dk_row + dk_col + dqk_diag[..., None] * qc + alpha * dka + omega * dkw
    db = qc * dq_g + kc * dk_row - kc * dk_col + qa * dqa + ka * dka - kw * dkw
    db = db.at[..., -1, :].add(jnp.sum(kw * dkw, axis=-2) + lam * dlam)
    dg = jnp.flip(jnp.cumsum(jnp.flip(db, -2), -2), -2)
    return (dq.reshape(q.shape), dk.reshape(k.shape), drb.reshape(v.shape), dg.reshape(g.shape),
            dbeta.reshape(beta.shape), dh0)
