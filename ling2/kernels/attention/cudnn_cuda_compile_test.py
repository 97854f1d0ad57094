"""attention_kernel=cudnn through the real XLA:GPU compiler, for an H100 with no GPU attached (cuda venv; any
host): the training form (causal, packed segments) must compile to cuDNN's fused attention, forward and
backward, where cuDNN takes the head dims, and to no cuDNN call where it does not (MLA's 192-wide heads)."""

import jax
import jax.numpy as jnp
import pytest

from ling2.kernels.testing.cuda import CUDNN_ATTENTION, h100_arg
from ling2.kernels.attention import cudnn


@pytest.mark.parametrize("K, V, calls", [(96, 64, 2), (192, 128, 0)])
def test_cudnn_kernel_compiles_to_cudnn_attention_for_h100(K, V, calls):
    B, T, H = 2, 512, 4

    def loss(q, k, v, seg):
        o = cudnn.cudnn_attention(q, k, v, seg, K**-0.5, block=128)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    qk, v = h100_arg((B, T, H, K), jnp.bfloat16), h100_arg((B, T, H, V), jnp.bfloat16)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(qk, qk, v, h100_arg((B, T), jnp.int32)).compile().as_text()
    assert text.count(CUDNN_ATTENTION) == calls
