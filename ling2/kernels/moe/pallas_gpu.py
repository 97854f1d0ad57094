"""Grouped matmul on NVIDIA GPUs (Pallas Triton): rows sorted by group, each group times its own matrix.

The dropless MoE's three products per weight (ling2.kernels.moe.gmm), with rows x_MQ sorted by expert and
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
(the tests) computes the same sums as a float32 reference. Float8 operands (`quantization: fp8`, per-tensor
scaling: `grouped_swiglu_fp8`) are loaded as float8, one byte each, and multiplied as float16, which is exact
(`ling2.kernels.triton_blocks.dot` says why not as float8); each kernel multiplies its fp32 sums by the operands'
scales (one scalar, `scale`) before it stores them.
Axes in names: M rows (a multiple of the row tile), G groups, Q contracted dim, P output dim, V visits.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ling2.kernels import fp8
from ling2.kernels.triton_blocks import dot

# gmm: rows x P columns per program, Q per step of its loop; tgmm: Q x P per program, rows per step.
GMM_TILES = (128, 128, 64)  # (tm, tp, tq)
TGMM_TILES = (64, 128, 128)  # (tm, tq, tp)
GMM_WARPS, GMM_STAGES = 4, 4
SWIGLU_WARPS = 8  # two [tm, tp] accumulators
TGMM_WARPS, TGMM_STAGES = 4, 4
SMEM_BUDGET = 192 * 1024  # bytes of pipelined operand tiles per program (Hopper: 227 KiB of shared memory)


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


def _scale_arg(scale) -> list:
    """The kernels' optional scale input: [] or one fp32 [1] array."""
    return [] if scale is None else [jnp.reshape(scale, (1,)).astype(jnp.float32)]


def _row_mask(r0, lo, hi, tm, width):
    r_T1 = r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    return jnp.broadcast_to((r_T1 >= lo) & (r_T1 < hi), (tm, width))


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, *refs, tm, tp, tq, transpose_rhs, scaled):
    """refs: n (x_MQi, w_i) pairs, a scale [1] if scaled, then y_MP; y = [scale *] sum_i x_i @ w_i[g] (or
    w_i[g]^T) for the visit's rows."""
    *pairs, y_ref = refs
    scale_ref = pairs.pop() if scaled else None
    p, v = pl.program_id(0), pl.program_id(1)
    g, lo, hi = group_ref[v], lo_ref[v], hi_ref[v]
    G = pairs[1].shape[0]
    r0 = pl.multiple_of(tile_ref[v] * tm, tm)
    rows, cols = pl.ds(r0, tm), pl.ds(pl.multiple_of(p * tp, tp), tp)
    keep_TP = _row_mask(r0, lo, hi, tm, tp)
    gw = jnp.minimum(g, G - 1)

    @pl.when((hi > lo) & (g < G))
    def _():
        def body(j, acc_TP):  # every pair's step j in one loop: one software pipeline, filled once
            ks = pl.ds(pl.multiple_of(j * tq, tq), tq)
            for x_ref, w_ref in zip(pairs[::2], pairs[1::2]):
                w = w_ref[gw, cols, ks] if transpose_rhs else w_ref[gw, ks, cols]
                acc_TP = acc_TP + dot(x_ref[rows, ks], w, x_ref.dtype, tb=transpose_rhs)
            return acc_TP

        acc_TP = jax.lax.fori_loop(0, pairs[0].shape[1] // tq, body, jnp.zeros((tm, tp), jnp.float32))
        if scaled:
            acc_TP = acc_TP * scale_ref[0]
        pltriton.store(y_ref.at[rows, cols], acc_TP.astype(y_ref.dtype), mask=keep_TP)

    @pl.when((hi > lo) & (g == G))
    def _():
        pltriton.store(y_ref.at[rows, cols], jnp.zeros((tm, tp), y_ref.dtype), mask=keep_TP)


def _params(warps, stages, interpret):
    return None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _stages(want: int, stage_bytes: int) -> int:
    """The pipeline depth: `want`, or fewer where that many stages of operand tiles would pass SMEM_BUDGET."""
    return max(1, min(want, SMEM_BUDGET // stage_bytes))


def gmm(x_MQ, w, gs_G, *, transpose_rhs: bool = False, interpret: bool = False, more=(), scale=None,
        out_dtype=None):
    """y [M, P] = per-group x @ w[g] (or w[g]^T) + the same product of each (x_i, w_i) pair in `more` (same M, Q,
    P and transposition; one kernel, one output, the pairs' steps interleaved in one loop), times `scale` (an
    fp32 scalar) if given, in out_dtype (default x's); rows past sum(gs_G) are zeros. M a multiple of
    GMM_TILES[0], Q and P multiples of 16 (float8: 32); w in x's dtype, or both float8."""
    M, Q = x_MQ.shape
    G = w.shape[0]
    P = w.shape[1] if transpose_rhs else w.shape[2]
    pairs = [(x_MQ, w), *more]
    if any(x.shape != (M, Q) or v.shape != w.shape for x, v in pairs):
        raise ValueError(f"gmm: every pair must have x {(M, Q)} and w {w.shape}, got "
                         f"{[(x.shape, v.shape) for x, v in pairs]}")
    tm, tp, tq = GMM_TILES[0], _fit(GMM_TILES[1], P), _fit(GMM_TILES[2], Q)
    meta = visits(gs_G, M, tm)
    kernel = functools.partial(_gmm_kernel, tm=tm, tp=tp, tq=tq, transpose_rhs=transpose_rhs,
                               scaled=scale is not None)
    stage_bytes = len(pairs) * (tm + tp) * tq * x_MQ.dtype.itemsize
    return pl.pallas_call(
        kernel, grid=(P // tp, meta[0].shape[0]), out_shape=jax.ShapeDtypeStruct((M, P), out_dtype or x_MQ.dtype),
        interpret=interpret, name="ling2_gmm_t" if transpose_rhs else "ling2_gmm",
        compiler_params=_params(GMM_WARPS, _stages(GMM_STAGES, stage_bytes), interpret),
    )(*meta, *(a for pair in pairs for a in pair), *_scale_arg(scale))


def _swiglu_kernel(group_ref, tile_ref, lo_ref, hi_ref, x_ref, wg_ref, wu_ref, *refs, tm, tp, tq, scaled):
    """One x tile feeds both the gate and the up product; h = silu(gate) * up from the fp32 sums (times the
    scale [1] that leads refs if scaled)."""
    scale_ref, h_ref, g_ref, u_ref = refs if scaled else (None, *refs)
    p, v = pl.program_id(0), pl.program_id(1)
    g, lo, hi = group_ref[v], lo_ref[v], hi_ref[v]
    G, Q = wg_ref.shape[0], x_ref.shape[1]
    r0 = pl.multiple_of(tile_ref[v] * tm, tm)
    rows, cols = pl.ds(r0, tm), pl.ds(pl.multiple_of(p * tp, tp), tp)
    keep_TP = _row_mask(r0, lo, hi, tm, tp)
    gw = jnp.minimum(g, G - 1)
    dt = x_ref.dtype

    @pl.when((hi > lo) & (g < G))
    def _():
        def body(j, accs):
            ks = pl.ds(pl.multiple_of(j * tq, tq), tq)
            x_TQ = x_ref[rows, ks]
            return accs[0] + dot(x_TQ, wg_ref[gw, ks, cols], dt), accs[1] + dot(x_TQ, wu_ref[gw, ks, cols], dt)

        zeros = jnp.zeros((tm, tp), jnp.float32)
        gate_TP, up_TP = jax.lax.fori_loop(0, Q // tq, body, (zeros, zeros))
        if scaled:
            gate_TP, up_TP = gate_TP * scale_ref[0], up_TP * scale_ref[0]
        for ref, val in ((h_ref, jax.nn.silu(gate_TP) * up_TP), (g_ref, gate_TP), (u_ref, up_TP)):
            pltriton.store(ref.at[rows, cols], val.astype(ref.dtype), mask=keep_TP)

    @pl.when((hi > lo) & (g == G))
    def _():
        for ref in (h_ref, g_ref, u_ref):
            pltriton.store(ref.at[rows, cols], jnp.zeros((tm, tp), ref.dtype), mask=keep_TP)


def swiglu_gmm(x_MD, wg, wu, gs_G, *, interpret: bool = False, scale=None, out_dtype=None):
    """(h, gate, up), each [M, F] in out_dtype (default x's): per group, gate = x @ wg[g], up = x @ wu[g] (each
    times `scale`, an fp32 scalar, if given), h = silu(gate) * up, all from the same fp32 sums (h is not
    recomputed from the rounded gate and up); rows past sum(gs_G) are zeros. M a multiple of GMM_TILES[0], D
    and F multiples of 16 (float8: 32)."""
    (M, D), F = x_MD.shape, wg.shape[2]
    tm, tp, tq = GMM_TILES[0], _fit(GMM_TILES[1], F), _fit(GMM_TILES[2], D)
    meta = visits(gs_G, M, tm)
    out = jax.ShapeDtypeStruct((M, F), out_dtype or x_MD.dtype)
    return pl.pallas_call(
        functools.partial(_swiglu_kernel, tm=tm, tp=tp, tq=tq, scaled=scale is not None),
        grid=(F // tp, meta[0].shape[0]), out_shape=(out, out, out), interpret=interpret, name="ling2_gmm_swiglu",
        compiler_params=_params(SWIGLU_WARPS, _stages(GMM_STAGES, (tm + 2 * tp) * tq * x_MD.dtype.itemsize), interpret),
    )(*meta, x_MD, wg, wu, *_scale_arg(scale))


def _tgmm_kernel(lo_ref, hi_ref, x_ref, *refs, tm, tq, tp, n, scaled):
    """refs: n dy_MP, a scale [1] if scaled, then n dw [G, Q, P]: dw_i[g] block = [scale *] x^T dy_i over group
    g's rows, one read of x for all."""
    dys, dws = refs[:n], refs[n + scaled:]
    p, q, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[g], hi_ref[g]
    qs, ps = pl.ds(pl.multiple_of(q * tq, tq), tq), pl.ds(pl.multiple_of(p * tp, tp), tp)
    dt = x_ref.dtype

    def body(t, accs):
        r0 = pl.multiple_of(t * tm, tm)
        r_T1 = r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        live_T1 = (r_T1 >= lo) & (r_T1 < hi)
        x_TQ = pltriton.load(x_ref.at[pl.ds(r0, tm), qs], mask=jnp.broadcast_to(live_T1, (tm, tq)), other=0.0)
        return tuple(acc_QP + dot(x_TQ, pltriton.load(dy_ref.at[pl.ds(r0, tm), ps],
                                                      mask=jnp.broadcast_to(live_T1, (tm, tp)), other=0.0), dt, ta=True)
                     for acc_QP, dy_ref in zip(accs, dys))

    zeros = tuple(jnp.zeros((tq, tp), jnp.float32) for _ in dys)
    accs = jax.lax.fori_loop(lo // tm, (hi + tm - 1) // tm, body, zeros)
    for dw_ref, acc_QP in zip(dws, accs):
        dw_ref[g, qs, ps] = (acc_QP * refs[n][0] if scaled else acc_QP).astype(dw_ref.dtype)


def tgmm(x_MQ, dy_MP, gs_G, *, interpret: bool = False, more=(), scale=None, out_dtype=None):
    """dw [G, Q, P] = per-group x^T @ dy over each group's rows (zeros for an empty group), times `scale` (an fp32
    scalar) if given, in out_dtype (default x's); with `more` (further dy_i of dy's shape) a tuple of such
    gradients, one per dy, from one read of x. M a multiple of TGMM_TILES[0], Q and P multiples of 16 (float8:
    32)."""
    (M, Q), P, G = x_MQ.shape, dy_MP.shape[1], gs_G.shape[0]
    dys = (dy_MP, *more)
    tm, tq, tp = TGMM_TILES[0], _fit(TGMM_TILES[1] // len(dys), Q), _fit(TGMM_TILES[2], P)
    end = jnp.cumsum(gs_G.astype(jnp.int32))
    out = jax.ShapeDtypeStruct((G, Q, P), out_dtype or x_MQ.dtype)
    dws = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm, tq=tq, tp=tp, n=len(dys), scaled=scale is not None),
        grid=(P // tp, Q // tq, G), out_shape=(out,) * len(dys), interpret=interpret, name="ling2_tgmm",
        compiler_params=_params(TGMM_WARPS, _stages(TGMM_STAGES, (tq + len(dys) * tp) * tm * x_MQ.dtype.itemsize),
                                interpret),
    )(end - gs_G.astype(jnp.int32), end, x_MQ, *dys, *_scale_arg(scale))
    return dws if more else dws[0]


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


def _pad_to(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)]) if extra else x


def grouped_matmul(x_MQ, w, gs_G, *, transpose_rhs: bool = False, interpret: bool = False):
    """Differentiable gmm for any M, Q, P: rows are padded to whole row tiles and Q, P to multiples of 16
    with zeros (which add nothing), and the result sliced back; w is cast to x's dtype."""
    M = x_MQ.shape[0]
    P = w.shape[1] if transpose_rhs else w.shape[2]
    x = _pad_to(_pad_to(x_MQ, 0, max(GMM_TILES[0], TGMM_TILES[0])), 1, 16)
    w = _pad_to(_pad_to(w.astype(x_MQ.dtype), 1, 16), 2, 16)
    return _gmm_vjp(x, w, gs_G.astype(jnp.int32), transpose_rhs, interpret)[:M, :P]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _swiglu_vjp(x_MD, gs_G, wg, wu, wd, interpret):
    h_MF = swiglu_gmm(x_MD, wg, wu, gs_G, interpret=interpret)[0]
    return gmm(h_MF, wd, gs_G, interpret=interpret)


def _swiglu_vjp_fwd(x_MD, gs_G, wg, wu, wd, interpret):
    h_MF, gate_MF, up_MF = swiglu_gmm(x_MD, wg, wu, gs_G, interpret=interpret)
    return gmm(h_MF, wd, gs_G, interpret=interpret), (x_MD, gs_G, wg, wu, wd, h_MF, gate_MF, up_MF)


def _swiglu_vjp_bwd(interpret, res, dy_MD):
    x_MD, gs_G, wg, wu, wd, h_MF, gate_MF, up_MF = res
    dh_MF = gmm(dy_MD, wd, gs_G, transpose_rhs=True, interpret=interpret)
    dgate_MF, dup_MF = (d.astype(x_MD.dtype) for d in _swiglu_derivative(dh_MF, gate_MF, up_MF))
    dx_MD = gmm(dgate_MF, wg, gs_G, transpose_rhs=True, interpret=interpret, more=((dup_MF, wu),))
    dwg, dwu = tgmm(x_MD, dgate_MF, gs_G, interpret=interpret, more=(dup_MF,))
    return dx_MD, None, dwg, dwu, tgmm(h_MF, dy_MD, gs_G, interpret=interpret)


_swiglu_vjp.defvjp(_swiglu_vjp_fwd, _swiglu_vjp_bwd)


def grouped_swiglu(x_MD, gs_G, wg, wu, wd, *, interpret: bool = False):
    """Differentiable grouped SwiGLU, y [M, D] = per group (silu(x @ wg[g]) * (x @ wu[g])) @ wd[g], wg, wu
    [G, D, F], wd [G, F, D] (cast to x's dtype); rows past sum(gs_G) are zeros. Forward: the fused gate/up
    kernel (the rows read once for both, h written directly) and one gmm; backward: a transposed gmm (dh), the
    SwiGLU's derivative (fused by XLA), one transposed gmm summing both products (dx), one tgmm for the down
    weights and one for gate and up together (one read of the rows). Any M,
    D, F: padded with zeros to whole tiles and sliced back."""
    M, D = x_MD.shape
    tile = max(GMM_TILES[0], TGMM_TILES[0])
    dt = x_MD.dtype
    x = _pad_to(_pad_to(x_MD, 0, tile), 1, 16)
    wg, wu = (_pad_to(_pad_to(w.astype(dt), 1, 16), 2, 16) for w in (wg, wu))
    wd = _pad_to(_pad_to(wd.astype(dt), 1, 16), 2, 16)
    return _swiglu_vjp(x, gs_G.astype(jnp.int32), wg, wu, wd, interpret)[:M, :D]


def _swiglu_derivative(dh_MF, gate_MF, up_MF):
    """(dgate, dup), fp32: the gradients of silu(gate) * up given dh."""
    dh, gate, up = (a.astype(jnp.float32) for a in (dh_MF, gate_MF, up_MF))
    sig = jax.nn.sigmoid(gate)
    return dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _swiglu_fp8_vjp(x_MD, gs_G, wg, wu, wd, interpret):
    return _swiglu_fp8_fwd(x_MD, gs_G, wg, wu, wd, interpret)[0]


def _swiglu_fp8_fwd(x_MD, gs_G, wg, wu, wd, interpret):
    """The forward and its residuals: float8 rows, h and weights with their scales; gate and up in x's dtype;
    a zero of each weight's dtype (the gradients' dtypes)."""
    dt = x_MD.dtype
    x8, sx = fp8.quantize_tensor(x_MD)
    (wg8, wu8), sgu = fp8.quantize_tensors((wg, wu))
    wd8, sd = fp8.quantize_tensor(wd)
    h_MF, gate_MF, up_MF = swiglu_gmm(x8, wg8, wu8, gs_G, interpret=interpret, scale=sx * sgu, out_dtype=dt)
    h8, sh = fp8.quantize_tensor(h_MF)
    y_MD = gmm(h8, wd8, gs_G, interpret=interpret, scale=sh * sd, out_dtype=dt)
    zeros = jnp.zeros((), wg.dtype), jnp.zeros((), wd.dtype)
    return y_MD, (x8, sx, wg8, wu8, sgu, wd8, sd, h8, sh, gate_MF, up_MF, gs_G, zeros)


def _swiglu_fp8_bwd(interpret, res, dy_MD):
    x8, sx, wg8, wu8, sgu, wd8, sd, h8, sh, gate_MF, up_MF, gs_G, (zg, zd) = res
    wgu_dtype, wd_dtype = zg.dtype, zd.dtype
    dt = dy_MD.dtype
    g8, sg = fp8.quantize_tensor(dy_MD, fp8.E5M2)
    dh_MF = gmm(g8, wd8, gs_G, transpose_rhs=True, interpret=interpret, scale=sg * sd, out_dtype=dt)
    (dg8, du8), sdgu = fp8.quantize_tensors(_swiglu_derivative(dh_MF, gate_MF, up_MF), fp8.E5M2)
    dx_MD = gmm(dg8, wg8, gs_G, transpose_rhs=True, interpret=interpret, more=((du8, wu8),), scale=sdgu * sgu,
                out_dtype=dt)
    dwg, dwu = tgmm(x8, dg8, gs_G, interpret=interpret, more=(du8,), scale=sx * sdgu, out_dtype=wgu_dtype)
    dwd = tgmm(h8, g8, gs_G, interpret=interpret, scale=sh * sg, out_dtype=wd_dtype)
    return dx_MD, None, dwg, dwu, dwd


_swiglu_fp8_vjp.defvjp(_swiglu_fp8_fwd, _swiglu_fp8_bwd)


def grouped_swiglu_fp8(x_MD, gs_G, wg, wu, wd, *, interpret: bool = False):
    """`grouped_swiglu` with FP8 GEMMs, per-tensor current scaling (ling2.kernels.fp8's "tensor" mode): the rows
    and h in e4m3, each weight tensor in e4m3 (gate and up under one scale, as the halves of one [D, 2F]
    product), the output gradient and the gate/up gradients in e5m2 (gate and up jointly); all six products are
    float8 kernels with fp32 sums scaled on store, and the residuals kept for the backward are the float8 rows,
    h and weights (gate and up in x's dtype). Weight gradients come in the weights' dtypes. Any M, D, F: padded
    with zeros (which change no scale) to whole tiles and multiples of 32 (the float8 tensor-core step)."""
    M, D = x_MD.shape
    x = _pad_to(_pad_to(x_MD, 0, max(GMM_TILES[0], TGMM_TILES[0])), 1, 32)
    wg, wu = (_pad_to(_pad_to(w, 1, 32), 2, 32) for w in (wg, wu))
    wd = _pad_to(_pad_to(wd, 1, 32), 2, 32)
    return _swiglu_fp8_vjp(x, gs_G.astype(jnp.int32), wg, wu, wd, interpret)[:M, :D]
