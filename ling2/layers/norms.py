"""RMSNorm and GroupRMSNorm (Flax NNX), statistics in fp32, output in the input's dtype.

GroupRMSNorm is the output norm of the linear-attention layer: `num_groups` is the NUMBER
of groups G; the last dim F is split into [G, F/G], each group gets its own fp32 RMS, and
one weight of size F scales the result. G = 1 is RMSNorm over F.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x, weight, eps):
    """fp32 RMS over the last dim of x, times `weight` [last dim]; returned in x.dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def group_rms_norm(x, weight, num_groups, eps):
    """RMSNorm of each of `num_groups` equal slices of the last dim; `weight` spans the whole dim."""
    F = x.shape[-1]
    if F % num_groups:
        raise ValueError(f"group_norm_size: {num_groups} groups do not divide the feature dim {F}")
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], num_groups, F // num_groups)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y.reshape(x.shape) * weight.astype(jnp.float32)).astype(x.dtype)


def _ones(dim, dtype, names):
    return nnx.Param(jnp.ones((dim,), dtype), out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim (size `dim`), weight initialised to ones."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32, names=("norm",)):
        self.weight = _ones(dim, param_dtype, names)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class GroupRMSNorm(nnx.Module):
    """RMSNorm per group of the last dim (size `dim`, `num_groups` groups), one weight of size `dim`."""

    def __init__(self, dim: int, num_groups: int, *, eps: float, param_dtype=jnp.float32, names=("norm",)):
        if dim % num_groups:
            raise ValueError(f"group_norm_size: {num_groups} groups do not divide the feature dim {dim}")
        self.weight = _ones(dim, param_dtype, names)
        self.num_groups, self.eps = num_groups, eps

    def __call__(self, x):
        return group_rms_norm(x, self.weight[...], self.num_groups, self.eps)
