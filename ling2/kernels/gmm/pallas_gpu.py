"""Grouped matmul on NVIDIA GPUs (Pallas Triton): rows sorted by group, each group times its own matrix.

The dropless MoE's three products per weight (ling2.layers.moe_gmm), with rows x_MQ sorted by expert and
group sizes gs_G (rows past their sum belong to no group):
  gmm:  y[rows of g] = x[rows of g] @ w[g]        w [G, Q, P] (transpose_rhs: x @ w[g]^T, w [G, P, Q])
  tgmm: dw[g] = x[rows of g]^T @ dy[rows of g]    [G, Q, P], the weight gradient
`grouped_matmul` is gmm with its backward (a transposed gmm for dx, tgmm for dw) as a custom VJP.

Why a kernel: XLA:GPU lowers `jax.lax.ragged_dot`'s backward dense over the groups, and batched
matmuls over expert-pure row blocks must first copy each block's expert matrix. Here every program
reads its block of the group's matrix straight from the stacked weights.
gmm's grid is (P blocks, row-tile visits): a row tile that straddles a group edge is visited once per
group it touches and stores only that group's rows, so the extra work is under one tile per group and
no row is written twice. Rows past the groups (the "tail") are stored as zeros. P blocks run fastest,
so the programs in flight share their row tile and their group's matrix in L2.
tgmm's grid is (P blocks, Q blocks, groups): each program walks its group's row tiles, masking the
rows of neighbouring groups; an empty group's gradient is zeros.
Accumulation is fp32; with fp32 operands the dots are exact fp32 (HIGHEST), so interpret mode on a CPU
(the tests) computes the same sums as a float32 reference.
Axes in names: M rows (a multiple of the row tile), G groups, Q contracted dim, P output dim, V visits.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling2.kernels.triton_blocks import dot

# gmm: rows x P columns per program, Q per step of its loop; tgmm: Q x P per program, rows per step.
GMM_TILES = (128, 128, 64)  # (tm, tp, tq)
TGMM_TILES = (64, 128, 128)  # (tm, tq, tp)
GMM_WARPS, GMM_STAGES = 4, 4
TGMM_WARPS, TGMM_STAGES = 4, 4


def _fit(tile: int, n: int) -> int:
    """The largest power of two <= tile that divides n (n a multiple of 16)."""
    while n % tile:
        tile //= 2
    return tile


def visits(gs_G, M: int, tm: int):
    """gmm's row-tile visits, V = M // tm + G of them: (group_V, tile_V, lo_V, hi_V), int32.

    Visit i computes row tile tile_V[i] for group group_V[i] (G: the tail past the groups) and stores its
    rows in [lo_V[i], hi_V[i]); visits past the last one in use have lo = hi = 0 and do nothing."""
    G = gs_G.shape[0]
    gs = jnp.concatenate([gs_G.astype(jnp.int32), (M - gs_G.sum().astype(jnp.int32))[None]])
    end = jnp.cumsum(gs)
    start = end - gs
    first = start // tm
    n = jnp.where(gs > 0, (end + tm - 1) // tm - first, 0)
    cum = jnp.cumsum(n)
    i = jnp.arange(M // tm + G, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, i, side="right"), G).astype(jnp.int32)
    live = i < cum[-1]
    tile = jnp.where(live, first[group] + i - (cum - n)[group], 0)
    lo, hi = jnp.where(live, start[group], 0), jnp.where(live, end[group], 0)
    return group, tile.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, x_ref, w_ref, y_ref, *, tm, tp, tq, transpose_rhs):
    p, v = pl.program_id(0), pl.program_id(1)
    g, lo, hi = group_ref[v], lo_ref[v], hi_ref[v]
    G, Q = w_ref.shape[0], x_ref.shape[1]
    r0 = pl.multiple_of(tile_ref[v] * tm, tm)
    rows, cols = pl.ds(r0, tm), pl.ds(pl.multiple_of(p * tp, tp), tp)
    keep_TP = jnp.broadcast_to(((r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)) >= lo)
                               & ((r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)) < hi), (tm, tp))
    dt = x_ref.dtype
    gw = jnp.minimum(g, G - 1)

    @pl.when((hi > lo) & (g < G))
    def _():
        def body(j, acc_TP):
            ks = pl.ds(pl.multiple_of(j * tq, tq), tq)
            x_TQ = x_ref[rows, ks]
            if transpose_rhs:
                return acc_TP + dot(x_TQ, w_ref[gw, cols, ks], dt, tb=True)
            return acc_TP + dot(x_TQ, w_ref[gw, ks, cols], dt)

        acc_TP = jax.lax.fori_loop(0, Q // tq, body, jnp.zeros((tm, tp), jnp.float32))
        pltriton.store(y_ref.at[rows, cols], acc_TP.astype(y_ref.dtype), mask=keep_TP)

    @pl.when((hi > lo) & (g == G))
    def _():
        pltriton.store(y_ref.at[rows, cols], jnp.zeros((tm, tp), y_ref.dtype), mask=keep_TP)


def gmm(x_MQ, w, gs_G, *, transpose_rhs: bool = False, interpret: bool = False):
    """y [M, P] = per-group x @ w[g] (or w[g]^T); rows past sum(gs_G) are zeros. M a multiple of GMM_TILES[0],
    Q and P multiples of 16; w in x's dtype."""
    M, Q = x_MQ.shape
    G = w.shape[0]
    P = w.shape[1] if transpose_rhs else w.shape[2]
    tm, tp, tq = GMM_TILES[0], _fit(GMM_TILES[1], P), _fit(GMM_TILES[2], Q)
    meta = visits(gs_G, M, tm)
    kernel = functools.partial(_gmm_kernel, tm=tm, tp=tp, tq=tq, transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel, grid=(P // tp, meta[0].shape[0]), out_shape=jax.ShapeDtypeStruct((M, P), x_MQ.dtype),
        interpret=interpret, name="ling2_gmm_t" if transpose_rhs else "ling2_gmm",
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=GMM_WARPS, num_stages=GMM_STAGES),
    )(*meta, x_MQ, w)


def _tgmm_kernel(lo_ref, hi_ref, x_ref, dy_ref, dw_ref, *, tm, tq, tp):
    p, q, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[g], hi_ref[g]
    qs, ps = pl.ds(pl.multiple_of(q * tq, tq), tq), pl.ds(pl.multiple_of(p * tp, tp), tp)
    dt = x_ref.dtype

    def body(t, acc_QP):
        r0 = pl.multiple_of(t * tm, tm)
        r_T1 = r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        live_T1 = (r_T1 >= lo) & (r_T1 < hi)
        x_TQ = pltriton.load(x_ref.at[pl.ds(r0, tm), qs], mask=jnp.broadcast_to(live_T1, (tm, tq)), other=0)
        dy_TP = pltriton.load(dy_ref.at[pl.ds(r0, tm), ps], mask=jnp.broadcast_to(live_T1, (tm, tp)), other=0)
        return acc_QP + dot(x_TQ, dy_TP, dt, ta=True)

    acc_QP = jax.lax.fori_loop(lo // tm, (hi + tm - 1) // tm, body, jnp.zeros((tq, tp), jnp.float32))
    dw_ref[g, qs, ps] = acc_QP.astype(dw_ref.dtype)


def tgmm(x_MQ, dy_MP, gs_G, *, interpret: bool = False):
    """dw [G, Q, P] = per-group x^T @ dy over each group's rows (zeros for an empty group). M a multiple of
    TGMM_TILES[0], Q and P multiples of 16."""
    (M, Q), P, G = x_MQ.shape, dy_MP.shape[1], gs_G.shape[0]
    tm, tq, tp = TGMM_TILES[0], _fit(TGMM_TILES[1], Q), _fit(TGMM_TILES[2], P)
    end = jnp.cumsum(gs_G.astype(jnp.int32))
    kernel = functools.partial(_tgmm_kernel, tm=tm, tq=tq, tp=tp)
    return pl.pallas_call(
        kernel, grid=(P // tp, Q // tq, G), out_shape=jax.ShapeDtypeStruct((G, Q, P), x_MQ.dtype),
        interpret=interpret, name="ling2_tgmm",
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=TGMM_WARPS, num_stages=TGMM_STAGES),
    )(end - gs_G.astype(jnp.int32), end, x_MQ, dy_MP)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_vjp(x_MQ, w, gs_G, transpose_rhs, interpret):
    return gmm(x_MQ, w, gs_G, transpose_rhs=transpose_rhs, interpret=interpret)


def _gmm_vjp_fwd(x_MQ, w, gs_G, transpose_rhs, interpret):
    return _gmm_vjp(x_MQ, w, gs_G, transpose_rhs, interpret), (x_MQ, w, gs_G)


def _gmm_vjp_bwd(transpose_rhs, interpret, res, dy_MP):
    x_MQ, w, gs_G = res
    dx = gmm(dy_MP, w, gs_G, transpose_rhs=not transpose_rhs, interpret=interpret)
    dw = tgmm(dy_MP, x_MQ, gs_G, interpret=interpret) if transpose_rhs else tgmm(x_MQ, dy_MP, gs_G, interpret=interpret)
    return dx, dw, None


_gmm_vjp.defvjp(_gmm_vjp_fwd, _gmm_vjp_bwd)


def grouped_matmul(x_MQ, w, gs_G, *, transpose_rhs: bool = False, interpret: bool = False):
    """Differentiable gmm for any M, Q, P: rows are padded to whole row tiles and Q, P to multiples of 16
    with zeros (which add nothing), and the result sliced back; w is cast to x's dtype."""
    M = x_MQ.shape[0]
    Q = x_MQ.shape[1]
    P = w.shape[1] if transpose_rhs else w.shape[2]
    tile = max(GMM_TILES[0], TGMM_TILES[0])
    pm, pq, pp = -M % tile, -Q % 16, -P % 16
    x = jnp.pad(x_MQ, ((0, pm), (0, pq))) if pm or pq else x_MQ
    w = w.astype(x_MQ.dtype)
    if pq or pp:
        w = jnp.pad(w, ((0, 0), (0, pp), (0, pq)) if transpose_rhs else ((0, 0), (0, pq), (0, pp)))
    y = _gmm_vjp(x, w, gs_G.astype(jnp.int32), transpose_rhs, interpret)
    return y[:M, :P]
