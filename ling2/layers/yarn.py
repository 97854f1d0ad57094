"""RoPE frequencies for `rope_type` default or yarn, and the yarn attention scales.

Yarn (arXiv 2309.00071) blends interpolated (`inv_freq / factor`) and extrapolated
(`inv_freq`) frequencies with a linear ramp over the rotary dims whose wavelength falls
between `beta_fast` and `beta_slow` rotations of `original_max_position_embeddings`.
It also scales cos/sin by an amplitude (`attention_scaling`) and, for MLA with
`mscale_all_dim`, the softmax scale by mscale^2. `rope_type: default` ignores
`rope_factor`, as the reference ignores `factor` without a `rope_scaling` block.
All maths is float64 numpy done once at build time; tables are returned as float32.
"""

import math

import numpy as np

from ling2.config.specs import MLASpec, RopeSpec


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check(spec):
    if spec.rope_type not in ("default", "yarn"):
        raise ValueError(f"rope_type: expected 'default' or 'yarn', got {spec.rope_type!r}")


def rope_inv_freq(spec: RopeSpec) -> np.ndarray:
    """Inverse frequencies [rotary_dim // 2] float32 for the rotary dims shared by GLA and MLA."""
    _check(spec)
    dim, base = spec.rotary_dim, float(spec.rope_max_timescale)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    if spec.rope_type == "default":
        return extrapolation.astype(np.float32)
    factor = float(spec.rope_factor)
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations):
        return dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(spec.beta_fast)), 0)
    high = min(math.ceil(correction_dim(spec.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep_extrapolated = 1.0 - ramp
    inv = interpolation * (1.0 - keep_extrapolated) + extrapolation * keep_extrapolated
    return inv.astype(np.float32)


def rope_attention_scaling(spec: RopeSpec) -> float:
    """Amplitude multiplying cos and sin: 1 for default; yarn's mscale ratio otherwise."""
    _check(spec)
    if spec.rope_type == "default":
        return 1.0
    f = float(spec.rope_factor)
    if spec.mscale and spec.mscale_all_dim:
        return get_mscale(f, spec.mscale) / get_mscale(f, spec.mscale_all_dim)
    return get_mscale(f)


def mla_softmax_scale(spec: MLASpec) -> float:
    """MLA softmax scale: (nope + rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn."""
    _check(spec)
    scale = spec.qk_head_dim ** -0.5
    if spec.rope_type == "yarn" and spec.mscale_all_dim:
        m = get_mscale(float(spec.rope_factor), spec.mscale_all_dim)
        scale *= m * m
    return scale
