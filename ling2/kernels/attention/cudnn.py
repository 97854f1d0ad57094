"""cuDNN's fused flash attention through JAX for the causal, packed-document case (`cudnn_attention`), with
the head-dim check that decides whether it applies (`cudnn_fits`)."""

import functools

import jax
import jax.numpy as jnp

from ling2.kernels.attention.dense import blocked_attention


def cudnn_fits(K, V):
    """cuDNN's fused attention (through JAX) takes head dims in multiples of 8 up to 128, and up to 256 on
    Hopper and later GPUs (JAX asks the GPU it runs on: Ling2's 192 fits an H100, not an A100); v is padded
    to q's."""
    return K % 8 == 0 and V <= K and (K <= 128 or _cudnn_takes_head_dim(K))


@functools.cache
def _have_cudnn() -> bool:
    """Whether this JAX install can build cuDNN attention at all (its CUDA plugin finds cuDNN); without it,
    nothing here lowers for CUDA either."""
    return _cudnn_takes_head_dim(8)


@functools.cache
def _cudnn_takes_head_dim(K: int) -> bool:
    x = jax.ShapeDtypeStruct((1, 8, 1, K), jnp.bfloat16)
    try:
        jax.eval_shape(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn"), x)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def cudnn_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, block):
    """Causal, same-segment attention through cuDNN's fused flash attention when lowered for CUDA (segments as
    a mask, causality as cuDNN's own mask type); blocked_attention elsewhere, and where cuDNN cannot take the
    head dims (`cudnn_fits`) or JAX has no cuDNN. Needs T == S."""
    K, V = q_BTHK.shape[-1], v_BSHV.shape[-1]

    def fallback(q, k, v, seg):
        return blocked_attention(q, k, v, seg, scale, block)

    def fused(q, k, v, seg):
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, K - V)))  # zero columns change nothing
        same_B1TS = (seg[:, :, None] == seg[:, None, :])[:, None]
        o = jax.nn.dot_product_attention(q, k, v, mask=same_B1TS, scale=scale, is_causal=True,
                                         implementation="cudnn")
        return o[..., :V]

    if not (cudnn_fits(K, V) and _have_cudnn()):
        return fallback(q_BTHK, k_BSHK, v_BSHV, segment_BT)
    return jax.lax.platform_dependent(q_BTHK, k_BSHK, v_BSHV, segment_BT, cuda=fused, default=fallback)
