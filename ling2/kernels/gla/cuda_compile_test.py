"""The Pallas GPU (Triton) GLA kernels through the real XLA:GPU compiler, for an H100 with no GPU
attached (cuda venv; any host): JAX's CUDA plugin compiles for a described target
(`topology.devices("h100-1")`, a GpuTargetConfigProto). Forward+backward must call six
Triton kernels (forward: states sweep, outputs; backward: states sweep again, dstates reverse
sweep, dv, dqdk), found by their names, and "auto" must pick them. Each compile takes up to a
minute of CPU (Triton), so the cases are few.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import gla
from ling2.kernels.testing.cuda import TRITON, h100_arg

B, T, H = 2, 200, 2
KERNELS = ["ling2_gla_dqdk", "ling2_gla_dstates", "ling2_gla_dv", "ling2_gla_out", "ling2_gla_states",
           "ling2_gla_states"]  # the states sweep runs in the forward and again in the backward


def _args(D, dtype):
    s = h100_arg
    x = s((B, T, H, D), dtype)
    return x, x, x, s((B, T, H), jnp.float32), s((B, T), jnp.int32)


def _loss(backend, segments):
    def loss(q, k, v, g, seg):
        o = gla.simple_gla(q, k, v, g, segment_ids=seg if segments else None, backend=backend, interpret=None)
        o = o.astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))

    return loss


@pytest.mark.parametrize("backend, D, dtype, segments", [
    ("pallas_gpu", 64, jnp.float32, False),
    ("pallas_gpu", 128, jnp.bfloat16, True),
    ("auto", 64, jnp.bfloat16, True),
])
def test_triton_kernels_compile_for_h100(backend, D, dtype, segments):
    compiled = jax.jit(jax.grad(_loss(backend, segments), argnums=(0, 1, 2, 3))).lower(*_args(D, dtype)).compile()
    text = compiled.as_text()
    assert text.count(TRITON) == len(KERNELS)
    calls = [line for line in text.splitlines() if TRITON in line]
    assert sorted(m for line in calls for m in re.findall(r'name = "(ling2_gla_\w+)"', line)) == KERNELS
    assert compiled.memory_analysis().temp_size_in_bytes > 0
