"""Where a run executes: the device mesh, parameter shardings, global batches and device peak FLOP/s.

The mesh is (data, fsdp, expert, tensor) from cfg.ici_*_parallelism (one -1 fills the
devices). Parameters carry logical axis names (`out_sharding` metadata); the config's
`logical_axis_rules` map them to mesh axes (`ling2.layers.sharding.logical_to_spec`).
"""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ling2.config import ConfigError
from ling2.config.schema import MESH_AXES
from ling2.layers import sharding

# Peak dense bf16 FLOP/s per device, by a substring of jax's device_kind (lower case).
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12, "v5 lite": 197e12, "v5e": 197e12,
              "v5p": 459e12, "v5": 459e12, "v6 lite": 918e12, "v6e": 918e12, "v4": 275e12}


def mesh_shape(cfg, num_devices: int) -> tuple[int, ...]:
    """The (data, fsdp, expert, tensor) sizes from cfg.ici_*_parallelism; one -1 fills the rest.
    Raises ConfigError when they do not fit `num_devices`."""
    sizes = [getattr(cfg, f"ici_{a}_parallelism") for a in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"ici_*_parallelism: fixed sizes {dict(zip(MESH_AXES, sizes))} do not divide the "
                              f"{num_devices} devices")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(f"ici_*_parallelism: mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                          f"have {num_devices}")
    return tuple(sizes)


def make_mesh(cfg, devices=None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over `devices` (default: all)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def state_shardings(state, mesh: Mesh, rules):
    """NamedShardings for an nnx.State whose Variables carry logical `out_sharding` names."""
    rules = sharding.rules_dict(rules)

    def one(v):
        names = v.get_metadata().get("out_sharding")
        if not names:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, sharding.logical_to_spec(tuple(names), v.shape, rules, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(cfg, mesh: Mesh, rows: int) -> NamedSharding:
    """Sharding of a global [M, rows, S] batch array: rows split like activations."""
    spec = sharding.logical_to_spec(("activation_batch",), (rows,), sharding.rules_dict(cfg.logical_axis_rules), mesh)
    return NamedSharding(mesh, PartitionSpec(None, *spec))


def to_global(batch: dict, cfg, mesh) -> dict:
    """Host-local numpy [M, b_local, S] -> global arrays [M, b, S], rows sharded like activations."""
    out = {}
    for k, x_MBS in batch.items():
        x_MBS = np.asarray(x_MBS)
        shard = batch_sharding(cfg, mesh, x_MBS.shape[1] * jax.process_count())
        if jax.process_count() == 1:
            out[k] = jax.device_put(x_MBS, shard)
        else:
            out[k] = jax.make_array_from_process_local_data(shard, x_MBS)
    return out


def peak_flops_per_device(device=None) -> float:
    """Peak dense FLOP/s of one device: the table for accelerators, a quick fp32 matmul measure on CPU."""
    d = device or jax.devices()[0]
    kind = getattr(d, "device_kind", "").lower()
    for k, v in PEAK_FLOPS.items():
        if k in kind:
            return v
    n = 1024
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(3):  # best of three: the machine may be busy
        t = time.perf_counter()
        for _ in range(5):
            y = f(x)
        y.block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 5 * 2 * n**3 / best / max(len(jax.local_devices()), 1)
