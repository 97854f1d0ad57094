"""attention_kernel=flash through the real XLA:TPU + Mosaic compiler (tpu venv; any host): the
splash attention kernels, not their interpreted form, when compiled for a v5p from a CPU host.
Forward+backward: three Mosaic calls (forward, dq, dk/dv) and no while loop (interpret mode's)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2.kernels.attention import splash
from ling2.layers.attention import mla as attention_mla
from ling2 import topology


def test_splash_attention_compiles_to_mosaic_for_v5p():
    mesh = Mesh(np.array(topology.devices("v5p-8")[:1]), ("d",))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    qk, v, seg = s((2, 1024, 4, 192), jnp.bfloat16), s((2, 1024, 4, 128), jnp.bfloat16), s((2, 1024), jnp.int32)

    def loss(q, k, v, seg):
        o = splash.splash_attention(q, k, v, seg, 0.1).astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qk, qk, v, seg).compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 3
    assert " while(" not in text


def test_splash_attention_under_context_parallelism_compiles_to_mosaic_for_v5p():
    """Queries split 4 ways over the context axis of a v5p-8 (4 chips), keys whole: still the three
    Mosaic kernels, one shard_map, no interpreted loop, and each chip's mask blocks only its own rows'."""
    from jax.sharding import AxisType
    from ling2.config.schema import MESH_AXES
    import dataclasses

    from ling2.config import load_config
    from ling2.config.specs import RunSpec

    devices = np.array(topology.devices("v5p-8")[:4]).reshape(1, 1, 1, 1, 4, 1)
    mesh = Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    rules = [("activation_batch", ["data", "fsdp"]), ("activation_length", ["context"]),
             ("activation_heads", ["tensor"])]
    run = dataclasses.replace(RunSpec.of(load_config(), mesh),
                              logical_axis_rules=tuple((n, tuple(a)) for n, a in rules))
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))
    qk, v, seg = s((2, 2048, 4, 192), jnp.bfloat16), s((2, 2048, 4, 128), jnp.bfloat16), s((2, 2048), jnp.int32)

    def loss(q, k, v, seg):
        o = attention_mla.splash_context_attention(q, k, v, seg, 0.1, run).astype(jnp.float32)
        return jnp.sum(o * jnp.cos(o))

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qk, qk, v, seg).compile().as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 3
    assert " while(" not in text
