"""What the Pallas GPU (Triton) kernels of every op share: operand padding (Triton blocks need
power-of-two sizes of at least 16, so head dims are padded up with zeros, which add nothing to any
product, and the results sliced back) and the in-kernel matmul."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def pow2(n: int) -> int:
    """The Triton block size for a dim of n: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def pad_last(x, d: int):
    """x with its last dim zero-padded to d."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d - x.shape[-1])])


def pad_state(x_KV, K: int, V: int):
    """A state [..., k, v] as fp32, zero-padded to [..., K, V]."""
    return jnp.pad(x_KV.astype(jnp.float32),
                   [(0, 0)] * (x_KV.ndim - 2) + [(0, K - x_KV.shape[-2]), (0, V - x_KV.shape[-1])])


def dot(a, b, dt, ta=False, tb=False):
    """a @ b (optionally transposed) on operands cast to dt, fp32 accumulation; exact fp32 when dt is fp32.
    With bf16 inputs an fp32 state enters its matmuls as bf16 (as fla does); it accumulates in fp32.
    A float8 dt (e4m3 or e5m2, operands possibly mixed) means float16, which holds every value of both exactly:
    Pallas' Triton lowering takes one dtype and sets no maxNumImpreciseAcc, without which Triton runs a float8 dot
    on Ampere's mma.sync; as float16 it runs on Hopper's wgmma at the 16-bit rate, from loads of half the bytes
    (ling2/kernels/moe/fp8_cuda_compile_test.py)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    if dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        dt = jnp.float16
    a, b = a.astype(dt), b.astype(dt)
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def grid_call(kernel, args, outs, kinds, BV, interpret, num_warps=4, num_stages=1):
    """The kernel on grid (B, H, V / BV): one program per batch row, head and block of BV value columns.
    kinds[i] for each arg then output: "full" (the whole per-head array), "v" (last dim, V, split into
    blocks of BV) or "part" (one slice per V block on a leading axis: per-block partial sums).
    num_stages: Triton's software pipeline depth for the loads of the kernel's loops (1: none)."""
    B, H = args[0].shape[:2]
    NV = next(x for x, kd in zip(list(args) + list(outs), kinds) if kd == "v").shape[-1] // BV

    def spec(x, kind):
        if kind == "part":
            return pl.BlockSpec((None, None, None) + x.shape[3:], lambda b, h, j: (j, b, h) + (0,) * (x.ndim - 3))
        if kind == "v":
            return pl.BlockSpec((None, None) + x.shape[2:-1] + (BV,),
                                lambda b, h, j: (b, h) + (0,) * (x.ndim - 3) + (j,))
        return pl.BlockSpec((None, None) + x.shape[2:], lambda b, h, j: (b, h) + (0,) * (x.ndim - 2))

    return pl.pallas_call(
        kernel, grid=(B, H, NV), in_specs=[spec(a, kd) for a, kd in zip(args, kinds)],
        out_specs=[spec(o, kd) for o, kd in zip(outs, kinds[len(args):])], out_shape=outs, interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(*args)
