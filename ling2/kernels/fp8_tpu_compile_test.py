"""quantization=fp8 through the real XLA:TPU compiler for a v5p, which has no FP8 matmul units (tpu venv; any
host): the documented emulation compiles, forward and backward, for the projections' einsums and the
experts' ragged_dot, and the f8 rounding survives in the optimized program (e4m3 operands; e5m2 gradients
with per-tensor scaling), so a TPU run studies the same numerics as a GPU one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology
from ling2.kernels import fp8


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_fp8_emulation_compiles_for_v5p_with_its_rounding(scaling):
    mesh = Mesh(np.array(topology.devices("v5p-8")[:1]), ("d",))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    q = fp8.Fp8(scaling)

    def proj(x, w):
        return jnp.sum(fp8.einsum("bte,eshd->btshd", x, w, q).astype(jnp.float32) ** 2)

    def experts(x, w, gs):
        return jnp.sum(fp8.ragged_dot(x, w, gs, q).astype(jnp.float32) ** 2)

    texts = [jax.jit(jax.grad(proj, argnums=(0, 1))).lower(s((2, 256, 512), jnp.bfloat16),
                                                           s((512, 3, 4, 128), jnp.bfloat16)).compile().as_text(),
             jax.jit(jax.grad(experts, argnums=(0, 1))).lower(s((512, 256), jnp.bfloat16), s((4, 256, 128), jnp.bfloat16),
                                                              s((4,), jnp.int32)).compile().as_text()]
    for text in texts:
        assert "f8e4m3fn" in text
        assert ("f8e5m2" in text) == (scaling == "tensor")
