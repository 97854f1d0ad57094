"""The Pallas GPU (Triton) KDA kernels through the real XLA:GPU compiler, for an H100 with no GPU
attached (cuda venv; any host): JAX's CUDA plugin compiles for a described target
(`topology.devices("h100-1")`). Forward+backward must call nine Triton kernels (the two prologue
kernels, pairs and solve, in the forward and again in the backward; forward sweep, state sweep,
reverse sweep; the gradients' value-side and key-side kernels). Each compile takes about a minute of CPU
(Triton), so the cases are few.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import kda
from ling2.kernels.testing.cuda import TRITON, h100_arg

B, T, H = 2, 200, 2


def _args(D, dtype):
    s = h100_arg
    x = s((B, T, H, D), dtype)
    return x, x, x, s((B, T, H, D), jnp.float32), s((B, T, H), jnp.float32), s((B, T), jnp.int32)


@pytest.mark.parametrize("D, dtype", [(64, jnp.float32), (128, jnp.bfloat16)])
def test_triton_kernels_compile_for_h100(D, dtype):
    def loss(q, k, v, g, beta, seg):
        o = kda.kda(q, k, v, g, beta, segment_ids=seg, backend="pallas_gpu", interpret=False)
        o = o.astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*_args(D, dtype)).compile()
    text = compiled.as_text()
    assert text.count(TRITON) == 9
    assert 'name = "ling2_kda_vgrad"' in text and 'name = "ling2_kda_kgrad"' in text
    assert compiled.memory_analysis().temp_size_in_bytes > 0
