"""Named topologies through libtpu's own topology code, and a compile on them (tpu venv, any host).

Reference: libtpu (its device count, device kind and slice indices for the requested layout)
and a hand count of a sharded matmul's bytes per chip.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ling2 import topology


@pytest.mark.parametrize("name", ["v4-8", "v4-32", "v4-256", "v5e-1", "v5e-256", "v5p-8", "v5p-128", "v5p-384",
                                  "v5p-2048", "v6e-1", "v6e-64", "v6e-256"])
def test_devices_match_the_layout(name):
    t = topology.parse(name)
    devs = topology.devices(name)
    assert len(devs) == t.num_devices
    assert {d.device_kind for d in devs} == {t.chip.device_kind}
    assert {d.platform for d in devs} == {"tpu"}
    coords = {tuple(d.coords) for d in devs}
    assert len(coords) == t.chips_per_slice  # one device per chip (v4 / v5p as megacore)
    for axis, size in enumerate(t.shape):
        assert {c[axis] for c in coords} == set(range(size))


@pytest.mark.parametrize("name, hosts", [("tpu7x-4", 1), ("tpu7x-64", 16)])
def test_ironwood_has_two_devices_per_chip(name, hosts):
    """libtpu's Ironwood: each chip's two TensorCores are two JAX devices at the same chip coordinates."""
    t = topology.parse(name)
    devs = topology.devices(name)
    assert len(devs) == t.num_devices == 2 * t.chips_per_slice
    assert {d.device_kind for d in devs} == {"TPU7x"}
    coords = [tuple(d.coords) for d in devs]
    assert len(set(coords)) == t.chips_per_slice and all(coords.count(c) == 2 for c in set(coords))
    assert len({d.process_index for d in devs}) == hosts


def test_multi_slice_devices():
    devs = topology.devices("v6e-16", num_slices=3)
    assert len(devs) == 48
    assert sorted({d.slice_index for d in devs}) == [0, 1, 2]
    assert all(sum(d.slice_index == s for d in devs) == 16 for s in range(3))


def test_sharded_compile_reports_per_chip_memory():
    """A [4096, 8192] x [8192, 1024] bf16 matmul, rows split over the 64 chips of a v5p-128:
    each chip holds 64 rows of x (1 MiB) and all of w (16 MiB) as arguments, 64 x 1024 out."""
    devs = topology.devices("v5p-128")
    mesh = Mesh(np.array(devs).reshape(64), ("data",))
    x = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None)))
    w = jax.ShapeDtypeStruct((8192, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes == 64 * 8192 * 2 + 8192 * 1024 * 2
    assert mem.output_size_in_bytes == 64 * 1024 * 2
    assert compiled.cost_analysis()["flops"] == pytest.approx(2 * 64 * 8192 * 1024, rel=0.01)

