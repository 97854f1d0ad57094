"""Grouped SwiGLU over rows sorted by expert (the dropless MoE's matmuls), and a row gather.

Shapes: M rows sorted by expert, group_sizes [E] (rows past their sum give zeros), D model
dim, F expert width.
  "ragged_dot": `jax.lax.ragged_dot`, which XLA:TPU lowers to grouped kernels.
  "tiled": XLA:CPU lowers ragged_dot to a dense [E, M, D] masked product (E times the work),
  so on CPU a loop walks expert-pure tiles of the sorted rows, one [tile, D] x [D, 2F] and one
  [tile, F] x [F, D] matmul each; only tiles in use run, and a hand-written backward keeps
  the loop out of reverse-mode autodiff.
  "blocked": XLA:GPU lowers ragged_dot's backward dense over the experts too (E times the work and
  memory: 151 GiB for ling2-small's step at 32K tokens, tools/bench/gpu/NOTES.md), so each expert's
  rows are padded to whole blocks and run as batched matmuls against per-block gathered weights.
  "pallas_gpu": Ling2's Pallas Triton grouped SwiGLU (ling2.kernels.moe.pallas_gpu): each program reads its
  block of the expert's weights straight from the stacked weights, forward and both backward products, with
  under one row tile of extra work per expert; gate and up share one read of the rows. Interpreted on CPU.
  "megablox": the Pallas TPU grouped-matmul kernels JAX ships (megablox `gmm`/`tgmm`, MaxText's
  TPU default). XLA:TPU lowers ragged_dot to grouped Mosaic kernels of its own, but counts them
  dense over the local experts in its cost analysis (11x the grouped FLOPs at 32 experts), and
  model_name=ling2's train step compiles several times slower with them (tools/bench/moe and
  tools/bench/compile NOTES). Interpreted on CPU.
  "auto" (moe_gmm_backend) is resolved per platform by the MoE layer's plan (`ling2.layers.moe.plan`).
With quantization=fp8 (`q`, ling2.kernels.fp8) a grouped matmul is an FP8 product through "pallas_gpu" (float8
kernels, per-tensor scaling only), "blocked" (its batched matmuls quantized per step) or ragged_dot; megablox
and the tiled scan keep bf16/fp32.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp

from ling2.kernels.moe import pallas_gpu as gmm_pallas_gpu
from ling2.kernels import fp8

F32 = jnp.float32


BACKENDS = ("ragged_dot", "tiled", "blocked", "pallas_gpu", "megablox")
GMMS = ("auto", *BACKENDS)  # moe_gmm_backend: "auto" is resolved by the MoE layer's plan (ling2.layers.moe.plan)


def ffn_ragged_dot(x_MD, group_sizes_E, wg, wu, wd, q: fp8.Fp8 | None = None):
    """Grouped SwiGLU on rows sorted by expert; rows past sum(group_sizes) give zeros."""
    mm = lambda a, w: fp8.ragged_dot(a, w, group_sizes_E, q)
    return mm(jax.nn.silu(mm(x_MD, wg)) * mm(x_MD, wu), wd)


def _tiles(gs_E, tile: int, M: int):
    """Tile i covers sorted rows [row0, row0 + nrows) of expert e; n tiles are in use.

    Tiles run in expert order, so a tile's spill past its group is rewritten by later tiles."""
    E = gs_E.shape[0]
    tiles_E = (gs_E + tile - 1) // tile
    end_E = jnp.cumsum(tiles_E)
    i = jnp.arange(-(-M // tile) + E)
    e_N = jnp.minimum(jnp.searchsorted(end_E, i, side="right"), E - 1)
    j_N = i - (end_E - tiles_E)[e_N]
    row0_N = (jnp.cumsum(gs_E) - gs_E)[e_N] + j_N * tile
    return e_N, row0_N, jnp.clip(gs_E[e_N] - j_N * tile, 0, tile), end_E[-1]


def _zeros_like(x, shape, dtype=None):
    """Zeros that vary over the same shard_map axes as x (loop carries must match the body's output)."""
    return jax.lax.full_like(x, 0, dtype, shape)


def _varying(x) -> frozenset:
    """Manual (shard_map) axes x varies over; jax 0.10 keeps them in aval.mat, older ones in aval.vma."""
    aval = jax.typeof(x)
    return frozenset(aval.mat.varying if hasattr(aval, "mat") else getattr(aval, "vma", ()))


def _sum_to(g, w):
    """Gradient g of w in w's dtype, summed over shard_map axes where g varies but w does not."""
    extra = tuple(sorted(_varying(g) - _varying(w)))
    return (jax.lax.psum(g, extra) if extra else g).astype(w.dtype)


def _upto(buf, n):
    """Zero rows >= n (the last tile's spill past the final group)."""
    return jnp.where((jnp.arange(buf.shape[0]) < n)[:, None], buf, 0)


def _tiled_fwd(x_MD, gs_E, wgu, wd, tile):
    (M, D), F = x_MD.shape, wd.shape[1]
    e_N, row0_N, nrows_N, n = _tiles(gs_E, tile, M)
    xp = jnp.pad(x_MD, ((0, tile), (0, 0)))

    def body(i, carry):
        y, gu = carry
        e, r0 = e_N[i], row0_N[i]
        gu_t = jax.lax.dynamic_slice_in_dim(xp, r0, tile) @ wgu[e]
        y_t = jax.nn.silu(gu_t[:, :F]) * gu_t[:, F:] @ wd[e]
        # Rows past this expert's group are overwritten later by the experts they belong to.
        return (jax.lax.dynamic_update_slice_in_dim(y, y_t, r0, 0),
                jax.lax.dynamic_update_slice_in_dim(gu, gu_t, r0, 0))

    init = (_zeros_like(x_MD, (M + tile, D)), _zeros_like(x_MD, (M + tile, 2 * F)))
    y, gu = jax.lax.fori_loop(0, n, body, init)
    total = gs_E.sum()
    return _upto(y, total)[:M], gu


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiled_swiglu(x_MD, gs_E, wgu, wd, tile):
    return _tiled_fwd(x_MD, gs_E, wgu, wd, tile)[0]


def _tiled_swiglu_fwd(x_MD, gs_E, wgu, wd, tile):
    y, gu = _tiled_fwd(x_MD, gs_E, wgu, wd, tile)
    return y, (x_MD, gs_E, wgu, wd, gu)


def _dot(a, b, ca: int, cb: int):
    """a . b contracting a's dim ca with b's dim cb, without materialised transposes."""
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())))


def _tiled_swiglu_bwd(tile, res, dy_MD):
    x_MD, gs_E, wgu, wd, gu = res
    M = x_MD.shape[0]
    e_N, row0_N, nrows_N, n = _tiles(gs_E, tile, M)
    xp, dyp = jnp.pad(x_MD, ((0, tile), (0, 0))), jnp.pad(dy_MD, ((0, tile), (0, 0)))

    def body(i, carry):
        dx, dwgu, dwd = carry
        e, r0 = e_N[i], row0_N[i]
        mask = (jnp.arange(tile) < nrows_N[i])[:, None]
        x_t = jax.lax.dynamic_slice_in_dim(xp, r0, tile)
        dy_t = jnp.where(mask, jax.lax.dynamic_slice_in_dim(dyp, r0, tile), 0)
        g, u = jnp.split(jax.lax.dynamic_slice_in_dim(gu, r0, tile), 2, axis=1)
        sg = jax.nn.sigmoid(g)
        dh = _dot(dy_t, wd[e], 1, 1)
        dwd = dwd.at[e].add(_dot(g * sg * u, dy_t, 0, 0))
        dgu = jnp.concatenate([dh * u * sg * (1 + g * (1 - sg)), dh * g * sg], axis=1)
        dwgu = dwgu.at[e].add(_dot(x_t, dgu, 0, 0))
        return jax.lax.dynamic_update_slice_in_dim(dx, _dot(dgu, wgu[e], 1, 1), r0, 0), dwgu, dwd

    init = (_zeros_like(x_MD, (M + tile, x_MD.shape[1])), _zeros_like(x_MD, wgu.shape, F32),
            _zeros_like(x_MD, wd.shape, F32))
    dx, dwgu, dwd = jax.lax.fori_loop(0, n, body, init)
    return _upto(dx, gs_E.sum())[:M], None, _sum_to(dwgu, wgu), _sum_to(dwd, wd)


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


def _block_size(M: int, E: int, block: int) -> int:
    """Rows per tile or block: `block`, or less for small inputs (a power of two >= 8 near the mean group
    size)."""
    return max(8, min(block, 1 << max(0, M // E).bit_length()))


def ffn_tiled(x_MD, group_sizes_E, wg, wu, wd, tile: int = 128):
    """Same contract as `ffn_ragged_dot`: a loop over expert-pure tiles of sorted rows, one
    [tile, D] x [D, 2F] and one [tile, F] x [F, D] matmul each (a hand-written backward keeps
    the loop out of reverse-mode autodiff). Only tiles in use run: waste < one tile per expert.
    Computes in fp32: XLA:CPU's small bf16 matmuls are several times slower than fp32 ones."""
    tile = _block_size(x_MD.shape[0], group_sizes_E.shape[0], tile)
    wgu = jnp.concatenate([wg, wu], axis=-1).astype(F32)
    y = _tiled_swiglu(x_MD.astype(F32), group_sizes_E.astype(jnp.int32), wgu, wd.astype(F32), tile)
    return y.astype(x_MD.dtype)


def ffn_blocked(x_MD, group_sizes_E, wg, wu, wd, block: int = 128, step_bytes: int = 256 << 20,
                q: fp8.Fp8 | None = None):
    """Same contract as `ffn_ragged_dot`, as batched matmuls: each expert's rows are padded to a multiple
    of `block`, so every block of rows belongs to one expert, and each block is one [block, D] x [D, 2F]
    and one [block, F] x [F, D] matmul against its expert's weights, gathered per block (cuBLAS batched
    GEMMs on GPU). Padding costs < one block per expert; blocks past those in use are zero rows.
    Blocks run in steps whose gathered weights take about `step_bytes` (a loop when there are more,
    each step rematerialised in the backward, so no step's gathered weights are kept). Autodiff gives
    the backward: the weight gradients are the per-block products summed into each expert."""
    (M, D), E, F = x_MD.shape, group_sizes_E.shape[0], wd.shape[1]
    b = _block_size(M, E, block)
    gs_E = group_sizes_E.astype(jnp.int32)
    blocks_E = (gs_E + b - 1) // b
    first_block_E = jnp.cumsum(blocks_E) - blocks_E
    end_E = jnp.cumsum(gs_E)
    N = -(-M // b) + E
    G = max(1, min(N, step_bytes // (3 * D * F * x_MD.dtype.itemsize)))  # blocks per step
    N = -(-N // G) * G
    m_M = jnp.arange(M)
    e_M = jnp.minimum(jnp.searchsorted(end_E, m_M, side="right"), E - 1)
    dest_M = jnp.where(m_M < end_E[-1], first_block_E[e_M] * b + m_M - (end_E - gs_E)[e_M], N * b)
    x_NbD = jnp.zeros((N * b, D), x_MD.dtype).at[dest_M].set(x_MD, mode="drop").reshape(N, b, D)
    e_N = jnp.minimum(jnp.searchsorted(jnp.cumsum(blocks_E), jnp.arange(N), side="right"), E - 1)
    wgu = jnp.concatenate([wg, wu], axis=-1).astype(x_MD.dtype)
    wd = wd.astype(x_MD.dtype)

    @jax.checkpoint
    def step(x_GbD, e_G):
        g_GbF, u_GbF = jnp.split(fp8.einsum("nbd,ndf->nbf", x_GbD, wgu[e_G], q), [F], axis=-1)
        return fp8.einsum("nbf,nfd->nbd", jax.nn.silu(g_GbF) * u_GbF, wd[e_G], q)

    if G == N:
        y_NbD = step(x_NbD, e_N)
    else:
        y_NbD = jax.lax.map(lambda a: step(*a), (x_NbD.reshape(N // G, G, b, D), e_N.reshape(N // G, G)))
    return y_NbD.reshape(N * b, D).at[dest_M].get(mode="fill", fill_value=0)


def ffn_pallas_gpu(x_MD, group_sizes_E, wg, wu, wd, *, q: fp8.Fp8 | None = None, interpret: bool = False):
    """Same contract as `ffn_ragged_dot`, by the Pallas Triton grouped SwiGLU (ling2.kernels.moe.pallas_gpu): gate
    and up from one read of the rows, h written directly, then the down projection; its backward is the kernels'
    own (transposed grouped matmuls for dx, one per expert for the weights). `q` (per-tensor scaling): the same
    kernels on float8 operands."""
    swiglu = gmm_pallas_gpu.grouped_swiglu if q is None else gmm_pallas_gpu.grouped_swiglu_fp8
    return swiglu(x_MD, group_sizes_E, wg, wu, wd, interpret=interpret)


def megablox_tile(D: int, F: int, interpret: bool = False) -> int | None:
    """Tile of megablox's contracted and output dims: the same for both (its backward swaps them),
    dividing D and F, a multiple of 128 for Mosaic (any common divisor when interpreted). None if
    Mosaic has none."""
    for t in (512, 256, 128):
        if D % t == 0 and F % t == 0:
            return t
    return math.gcd(D, F) if interpret else None


def ffn_megablox(x_MD, group_sizes_E, wg, wu, wd, *, interpret: bool = False):
    """Same contract as `ffn_ragged_dot`, by megablox's Pallas TPU kernels: rows are padded to a
    multiple of the row tile. The kernels leave rows past sum(group_sizes) unwritten, forward and
    backward, so those rows are zeroed after each matmul (their gradients too). Gate and up run
    as one [D, 2F] matmul."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    (M, D), F = x_MD.shape, wd.shape[1]
    t = megablox_tile(D, F, interpret)
    if t is None:
        raise ValueError(f"gmm: megablox needs the model dim ({D}) and expert width ({F}, per shard) to share a "
                         "multiple of 128; use moe_gmm_backend=auto or ragged_dot")
    tm = min(512, max(8, 1 << (M - 1).bit_length()))
    gs = group_sizes_E.astype(jnp.int32)
    valid = (jnp.arange(M + (-M % tm)) < gs.sum())[:, None]
    live = lambda a: jnp.where(valid, a, 0)
    mm = lambda a, b: live(gmm(a, b, gs, preferred_element_type=x_MD.dtype, tiling=(tm, t, t), interpret=interpret))
    wgu = jnp.concatenate([wg, wu], axis=-1).astype(x_MD.dtype)
    g, u = jnp.split(mm(live(jnp.pad(x_MD, ((0, valid.shape[0] - M), (0, 0)))), wgu), 2, axis=-1)
    return mm(jax.nn.silu(g) * u, wd.astype(x_MD.dtype))[:M]


def grouped_ffn(x_MD, group_sizes_E, w, gemm: str, *, q: fp8.Fp8 | None = None, interpret: bool | None = None):
    """Grouped SwiGLU of rows sorted by expert with weights w = (wg, wu, wd) by backend `gemm` (BACKENDS; the
    MoE layer's plan picks it for each platform, `ling2.layers.moe.plan`). `q`: FP8 GEMMs (the module doc),
    through pallas_gpu (per-tensor scaling), ragged_dot or blocked. `interpret` (Pallas backends): None runs the
    kernel in interpret mode off its platform, decided for the platform lowered for."""
    if gemm not in BACKENDS:
        raise ValueError(f"gmm: unknown grouped matmul backend {gemm!r} (one of {BACKENDS})")
    if q is not None and gemm == "pallas_gpu" and q.scaling != "tensor":
        raise ValueError(f"gmm: the pallas_gpu kernels run FP8 with per-tensor scaling only, not fp8_scaling="
                         f"{q.scaling!r} (block scaling: blocked or ragged_dot)")
    if q is not None and gemm != "pallas_gpu":
        if gemm not in ("ragged_dot", "blocked"):
            raise ValueError(f"gmm: FP8 grouped matmuls run through pallas_gpu, ragged_dot or blocked, not {gemm!r}")
        return (ffn_ragged_dot if gemm == "ragged_dot" else ffn_blocked)(x_MD, group_sizes_E, *w, q=q)
    if gemm == "ragged_dot":
        return ffn_ragged_dot(x_MD, group_sizes_E, *w)
    if gemm == "tiled":
        return ffn_tiled(x_MD, group_sizes_E, *w)
    if gemm == "blocked":
        return ffn_blocked(x_MD, group_sizes_E, *w)
    kernel, home = (partial(ffn_pallas_gpu, q=q), "cuda") if gemm == "pallas_gpu" else (ffn_megablox, "tpu")
    if interpret is not None:
        return kernel(x_MD, group_sizes_E, *w, interpret=interpret)
    if gemm == "pallas_gpu":
        return jax.lax.platform_dependent(x_MD, group_sizes_E, *w, cpu=partial(kernel, interpret=True),
                                          default=kernel)
    return jax.lax.platform_dependent(x_MD, group_sizes_E, *w, **{home: kernel},
                                      default=partial(kernel, interpret=True))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_rows(x_RD, idx_M, inv_R, k: int):
    """x_RD[idx_M] where each row of x appears exactly k times (inv_R lists them, k per row).

    The backward is a gather and a sum over the k copies instead of XLA's scatter-add.
    """
    return x_RD[idx_M]


def _gather_rows_fwd(x_RD, idx_M, inv_R, k):
    return x_RD[idx_M], (idx_M, inv_R)


def _gather_rows_bwd(k, res, dy_MD):
    idx_M, inv_R = res
    return dy_MD[inv_R].reshape(-1, k, dy_MD.shape[-1]).sum(1), None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
