"""The Pallas GPU grouped matmul through the real XLA:GPU compiler for an H100 with no GPU attached (cuda
venv; `topology.devices("h100-1")`): forward and both backward products compile to the three Triton kernels,
and the compiled program reads the stacked weights directly: no gather makes per-block copies of them."""

import re

import jax
import jax.numpy as jnp

from ling2.kernels.moe import pallas_gpu
from ling2.kernels.testing.cuda import TRITON, h100_arg


def test_gmm_forward_and_backward_compile_for_h100():
    M, D, F, G = 4096, 256, 128, 8
    x, w, gs = h100_arg((M, D), jnp.bfloat16), h100_arg((G, D, F), jnp.bfloat16), h100_arg((G,), jnp.int32)

    def loss(x, w, gs):
        return jnp.sum(pallas_gpu.grouped_matmul(x, w, gs).astype(jnp.float32) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, gs).compile().as_text()
    assert text.count(TRITON) == 3  # gmm, the transposed gmm (dx), tgmm (dw)
    assert not re.search(r"bf16\[\d+,%d,%d\]\{[^}]*\} gather\(" % (D, F), text)  # no [blocks, D, F] weight copies
