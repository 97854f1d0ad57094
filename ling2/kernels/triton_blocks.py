"""What the Pallas GPU (Triton) kernels of every op share: operand padding (Triton blocks need
power-of-two sizes of at least 16, so head dims are padded up with zeros, which add nothing to any
product, and the results sliced back) and the in-kernel matmul."""

import jax
import jax.numpy as jnp


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
    With bf16 inputs an fp32 state enters its matmuls as bf16 (as fla does); it accumulates in fp32."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    return jax.lax.dot_general(a.astype(dt), b.astype(dt), dims, precision=prec, preferred_element_type=jnp.float32)
