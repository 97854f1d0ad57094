"""Rotary position embedding, NeoX style (rotate-half), on the first `rotary_dim` dims.

Pairs dim i with i + rotary_dim/2 of the rotated part; the remaining dims pass through.
Default frequencies inv_freq_j = theta^(-2j / rotary_dim). Callers with scaled frequencies
(yarn) pass `inv_freq` and the cos/sin amplitude `scaling` instead.
"""

import jax.numpy as jnp
import numpy as np


def inv_frequencies(rotary_dim: int, theta: float) -> np.ndarray:
    """[rotary_dim // 2] float32: theta^(-arange(0, rotary_dim, 2) / rotary_dim), computed in float64."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim} must be a positive even number")
    return (1.0 / float(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)).astype(np.float32)


def apply_rotary(x_BTHD, positions_BT, rotary_dim: int, theta: float = 10000.0, *, inv_freq=None, scaling=1.0):
    """Rotates x's first `rotary_dim` dims by position; fp32 math, result in x's dtype.

    Args:
      x_BTHD: [B, T, H, D] with D >= rotary_dim.
      positions_BT: [B, T] integer positions.
      rotary_dim: rotated dims (even).
      theta: RoPE base, used when `inv_freq` is None.
      inv_freq: optional [rotary_dim // 2] frequencies overriding theta's.
      scaling: multiplies cos and sin (yarn's attention scaling; 1 otherwise).
    """
    D = x_BTHD.shape[-1]
    if rotary_dim > D:
        raise ValueError(f"rotary_dim={rotary_dim} exceeds head dim {D}")
    inv = inv_frequencies(rotary_dim, theta) if inv_freq is None else np.asarray(inv_freq, np.float32)
    if inv.shape != (rotary_dim // 2,):
        raise ValueError(f"inv_freq has shape {inv.shape}, expected ({rotary_dim // 2},)")
    angles = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [B, T, R/2]
    cos = (jnp.cos(angles) * scaling)[:, :, None]
    sin = (jnp.sin(angles) * scaling)[:, :, None]
    xf = x_BTHD.astype(jnp.float32)
    x1, x2 = xf[..., :rotary_dim // 2], xf[..., rotary_dim // 2:rotary_dim]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rotary_dim:]], axis=-1)
    return rotated.astype(x_BTHD.dtype)
