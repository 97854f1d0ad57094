"""FP8 matmuls (`quantization: fp8`): the dense projections and the routed experts' GEMMs with e4m3 operands.

A bilinear product y = f(x, w) (an einsum, a grouped matmul) runs on operands rounded to float8, with the
master weights, the optimizer and everything outside the GEMMs untouched. Two scalings (`fp8_scaling`):

  tensor  per-tensor current scaling: one fp32 scale per operand, amax / 448, computed on the fly. The
          forward GEMM takes e4m3 x and w, the backward GEMMs the gradient dy in e5m2 (the hybrid recipe:
          gradients need range more than precision) against the saved e4m3 operands. The f8 values reach
          the matmul as themselves (upcast exactly, the scales applied to the fp32 result), so XLA:GPU
          fuses them into FP8 GEMMs on Hopper (`fp8_cuda_compile_test`), and the residuals kept for the
          backward are the f8 tensors, half of bf16's bytes.
  block   fine-grained scaling, as DeepSeek-V3 and Ling 2.0 describe: x in 1 x 128 tiles along the
          contracted axis, w in 128 x 128 blocks of its [in, out] matrix, dy in 1 x 128 tiles along its
          output axis, each tile or block with its own scale, all e4m3. XLA has no block-scaled FP8
          GEMM in XLA, so this mode is an emulation on every platform: the operands are rounded exactly
          as the kernels round them, dequantized, and multiplied in fp32.

TPU v5p / v6e and CPUs have no FP8 matmul units: there both modes are emulations with the same rounding
(the compiler upcasts the f8 operands), which is what the CPU numerics runs measure
(tools/bench/fp8/NOTES.md). XLA:GPU drops a bf16 -> f8 -> bf16 round trip as "excess precision", which
would silently skip the rounding: every rounding sits behind an optimization barrier (tested in `fp8_test`,
on CPU and on a GPU). The fp32 products of the block mode run at full fp32 precision (not TF32).

Shapes: einsum letters as in the callers; K the contracted size, N the output size from w.
"""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

F32 = jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TILE = 128
SCALINGS = ("tensor", "block")


@dataclasses.dataclass(frozen=True)
class Fp8:
    """How a run quantizes its GEMMs: `scaling` one of SCALINGS."""
    scaling: str = "tensor"

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"fp8_scaling: unknown scaling {self.scaling!r} (one of {SCALINGS})")


def of(run) -> Fp8 | None:
    """The run's FP8 setting (a RunSpec: its quantization and fp8_scaling), or None when matmuls run in `dtype`."""
    return Fp8(run.fp8_scaling) if run.quantization == "fp8" else None


def _fmax(fmt) -> float:
    return float(jnp.finfo(fmt).max)


def _scale(amax, fmt):
    """fp32 scale mapping amax onto the format's largest value (1 where amax is 0)."""
    return jnp.where(amax > 0, amax / _fmax(fmt), 1.0).astype(F32)


def _cast(a_f32, s, fmt):
    """a / s rounded to `fmt`, behind an optimization barrier: XLA:GPU folds a f32 -> f8 -> f32 (or bf16) round
    trip away as excess precision, which would silently skip the rounding (`fp8_test` on a GPU caught it)."""
    return jax.lax.optimization_barrier(jnp.clip(a_f32 / s, -_fmax(fmt), _fmax(fmt)).astype(fmt))


def quantize_tensor(x, fmt=E4M3):
    """(x in `fmt` [x.shape], fp32 scale []) with x ~= x8 * scale. Divides in fp32 (see the module doc)."""
    a = x.astype(F32)
    s = _scale(jnp.max(jnp.abs(a)), fmt)
    return _cast(a, s, fmt), s


def quantize_tensors(xs, fmt=E4M3):
    """((x8, ...), scale): the tensors xs under one scale, their joint amax, as if they were one tensor (a
    SwiGLU's gate and up: the two halves of one [D, 2F] product and of its output's gradient)."""
    s = _scale(jnp.max(jnp.stack([jnp.max(jnp.abs(x.astype(F32))) for x in xs])), fmt)
    return tuple(_cast(x.astype(F32), s, fmt) for x in xs), s


def qdq_tiles(x, trailing: int, fmt=E4M3, tile: int = TILE):
    """x rounded in 1 x `tile` tiles along its last `trailing` axes (flattened), each tile scaled by its own
    amax; returned dequantized, fp32, shape of x. A short last tile is scaled on its own elements."""
    shape = x.shape
    lead, K = shape[:len(shape) - trailing], math.prod(shape[len(shape) - trailing:])
    a = x.astype(F32).reshape(lead + (K,))
    Kp = -(-K // tile) * tile
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, Kp - K)]).reshape(lead + (Kp // tile, tile))
    s = _scale(jnp.max(jnp.abs(a), axis=-1, keepdims=True), fmt)
    q = _cast(a, s, fmt).astype(F32) * s
    return q.reshape(lead + (Kp,))[..., :K].reshape(shape)


def qdq_blocks(w, batch: tuple, k: tuple, n: tuple, fmt=E4M3, tile: int = TILE):
    """w rounded in `tile` x `tile` blocks of its [K, N] matrix (K: the flattened axes `k`, N: the axes `n`),
    separately for each index of the `batch` axes (an expert); dequantized, fp32, shape of w."""
    perm = tuple(batch) + tuple(k) + tuple(n)
    a = jnp.transpose(w.astype(F32), perm)
    pshape = a.shape
    B = math.prod(pshape[:len(batch)])
    K = math.prod(pshape[len(batch):len(batch) + len(k)])
    N = math.prod(pshape[len(batch) + len(k):])
    Kp, Np = -(-K // tile) * tile, -(-N // tile) * tile
    a = jnp.pad(a.reshape(B, K, N), ((0, 0), (0, Kp - K), (0, Np - N)))
    a = a.reshape(B, Kp // tile, tile, Np // tile, tile)
    s = _scale(jnp.max(jnp.abs(a), axis=(2, 4), keepdims=True), fmt)
    q = (_cast(a, s, fmt).astype(F32) * s).reshape(B, Kp, Np)[:, :K, :N].reshape(pshape)
    return jnp.transpose(q, tuple(perm.index(i) for i in range(w.ndim)))


@dataclasses.dataclass(frozen=True)
class Axes:
    """Where f(x, w) contracts: x's last `x_k` axes; w's axes `w_batch`, `w_k`, `w_n`; y's last `y_n` axes
    come from w."""
    x_k: int
    w_batch: tuple
    w_k: tuple
    w_n: tuple
    y_n: int


def einsum_axes(spec: str) -> Axes:
    """The Axes of a two-operand einsum "x,w->y" whose contracted letters end x and whose letters from w end y."""
    ins, y = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    k = [c for c in x if c in w and c not in y]
    batch = [c for c in w if c in x and c in y]
    n = [c for c in w if c not in x]
    if x[len(x) - len(k):] != "".join(k) or y[len(y) - len(n):] != "".join(n):
        raise ValueError(f"fp8: einsum {spec!r} must contract the last axes of x and end its output with w's axes")
    return Axes(len(k), tuple(w.index(c) for c in batch), tuple(w.index(c) for c in k),
                tuple(w.index(c) for c in n), len(n))


def bilinear(f, x, w, *extra, q: Fp8, axes: Axes, transposes=None, out_dtype=None):
    """f(x, w, *extra) for f bilinear in (x, w) with an fp32 result; its operands and, in the backward, its
    output gradient are rounded to FP8 by `q` (the module doc). `extra`: arrays f also reads, not
    differentiated (group sizes). Gradients: dx and dw in x's and w's dtypes.

    `transposes`: (dx(dy, w), dw(x, dy)), the products of the backward, each taking float8 operands as they
    are (an einsum does): then every GEMM, forward and backward, is handed its f8 operands with an fp32
    result, the form XLA:GPU runs as an FP8 GEMM. Without them, f8 operands are widened exactly to x's dtype
    and f is differentiated by `jax.vjp` (ragged_dot)."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    ct = x.dtype  # e4m3 and e5m2 values are exact in bf16, f16 and f32

    def operands(x, w):
        if q.scaling == "tensor":
            (x8, sx), (w8, sw) = quantize_tensor(x), quantize_tensor(w)
            return (x8, w8), (sx, sw)
        return (qdq_tiles(x, axes.x_k), qdq_blocks(w, axes.w_batch, axes.w_k, axes.w_n)), (1.0, 1.0)

    def widen(a):
        return a if transposes else a.astype(ct) if a.dtype in (E4M3, E5M2) else a

    def fwd(x, w, *extra):
        (a, b), (sx, sw) = operands(x, w)
        y = (f(widen(a), widen(b), *extra).astype(F32) * (sx * sw)).astype(out_dtype)
        return y, (a, b, sx, sw, extra)

    def bwd(res, dy):
        a, b, sx, sw, extra = res
        if q.scaling == "tensor":
            g, sg = quantize_tensor(dy, E5M2)
        else:
            g, sg = qdq_tiles(dy, axes.y_n), 1.0
        if transposes:
            da, db = transposes[0](g, b, *extra), transposes[1](a, g, *extra)
        else:
            y, vjp = jax.vjp(lambda a, b: f(a, b, *extra), widen(a), widen(b))
            da, db = vjp(widen(g).astype(y.dtype))
        return ((da.astype(F32) * (sg * sw)).astype(x_dtype), (db.astype(F32) * (sx * sg)).astype(w_dtype),
                *(None for _ in extra))

    @jax.custom_vjp
    def product(x, w, *extra):
        return fwd(x, w, *extra)[0]

    x_dtype, w_dtype = x.dtype, w.dtype
    product.defvjp(fwd, bwd)
    return product(x, w, *extra)


def einsum(spec: str, x, w, q: Fp8 | None):
    """jnp.einsum(spec, x, w), in FP8 when `q` is set (output in x's dtype): three f8 einsums, the forward
    and the two of the backward."""
    if q is None:
        return jnp.einsum(spec, x, w)
    ins, y = spec.replace(" ", "").split("->")
    xs, ws = ins.split(",")
    prec = jax.lax.Precision.HIGHEST if q.scaling == "block" else None  # f32 operands: no TF32 on GPUs
    mm = lambda s: partial(jnp.einsum, s, preferred_element_type=F32, precision=prec)
    return bilinear(mm(spec), x, w, q=q, axes=einsum_axes(spec), transposes=(mm(f"{y},{ws}->{xs}"),
                                                                              mm(f"{xs},{y}->{ws}")))


def ragged_dot(x_MK, w_EKN, group_sizes_E, q: Fp8 | None):
    """jax.lax.ragged_dot, in FP8 when `q` is set (per-tensor scaling: one scale over all experts' weights;
    block: 128 x 128 blocks per expert)."""
    if q is None:
        return jax.lax.ragged_dot(x_MK, w_EKN, group_sizes_E)
    prec = jax.lax.Precision.HIGHEST if q.scaling == "block" else None
    f = lambda a, b, gs: jax.lax.ragged_dot(a, b, gs, preferred_element_type=F32, precision=prec)
    return bilinear(f, x_MK, w_EKN, group_sizes_E, q=q, axes=Axes(1, (0,), (1,), (2,), 1))
