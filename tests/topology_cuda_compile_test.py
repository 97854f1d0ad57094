"""Compile-only GPU devices: JAX's CUDA plugin compiling for H100 hosts with no GPU attached
(cuda venv; any host, JAX_PLATFORMS=cpu where there is no GPU).

Reference: a hand count of a sharded matmul's bytes per GPU, and the collective XLA must insert.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology


def test_h100_hosts():
    devs = topology.devices("h100-16")
    assert len(devs) == 16
    assert {d.device_kind for d in devs} == {"NVIDIA H100 80GB HBM3"}
    assert sorted({d.process_index for d in devs}) == [0, 1]  # 2 hosts of 8


def test_h200_hosts_carry_their_memory():
    """The H200 target (H100's Hopper die with 141 GB): 8 per host, and a sharded program compiles for it."""
    devs = topology.devices("h200-16")
    assert len(devs) == 16 and {d.device_kind for d in devs} == {"NVIDIA H200"}
    assert sorted({d.process_index for d in devs}) == [0, 1]
    x = jax.ShapeDtypeStruct((1 << 16, 1 << 16), jnp.bfloat16, sharding=NamedSharding(Mesh(np.array(devs), ("d",)),
                                                                                      P("d")))
    assert jax.jit(lambda a: a * 2).lower(x).compile().memory_analysis().argument_size_in_bytes == 2**29


def test_sharded_compile_for_two_h100_hosts():
    """x [4096, 4096] bf16 split 2 ways over hosts (rows) and 8 ways over GPUs (columns), w
    [4096, 4096] split over rows 8 ways: each GPU holds 2048 x 512 of x and 512 x 4096 of w
    (2 + 4 MiB); the contraction over the 8-way axis needs an all-reduce inside each host."""
    mesh = Mesh(np.array(topology.devices("h100-16")).reshape(2, 8), ("data", "model"))
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "model")))
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None)))
    compiled = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("data", None))).lower(x, w).compile()
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes == (2048 * 512 + 512 * 4096) * 2
    assert mem.output_size_in_bytes == 2048 * 4096 * 2
    text = compiled.as_text()
    assert "all-reduce" in text
    assert "replica_groups={{0,1,2,3,4,5,6,7},{8,9,10,11,12,13,14,15}}" in text
