"""attention_kernel=flash through the real XLA:TPU + Mosaic compiler (tpu venv; any host): the
splash attention kernels, not their interpreted form, when compiled for a v5p from a CPU host.
Forward+backward: three Mosaic calls (forward, dq, dk/dv) and no while loop (interpret mode's)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2.layers import attention_mla
from ling2 import topology


def test_splash_attention_compiles_to_mosaic_for_v5p():
    mesh = Mesh(np.array(topology.devices("v5p-8")[:1]), ("d",))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    qk, v, seg = s((2, 1024, 4, 192), jnp.bfloat16), s((2, 1024, 4, 128), jnp.bfloat16), s((2, 1024), jnp.int32)

    def loss(q, k, v, seg):
        o = attention_mla.splash_attention(q, k, v, seg, 0.1).astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qk, qk, v, seg).compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 3
    assert " while(" not in text
