"""Logical axis names -> mesh axes, by the rules in `cfg.logical_axis_rules`.

Parameters carry logical names in their `out_sharding` metadata (e.g. ("embed", "heads",
"kv")); activations are constrained with `constrain(x, names)`. Outside `use_mesh`
constraints are no-ops, so layers run unchanged on one device. A mesh axis is used at
most once per array and only on a dim it divides; otherwise that dim is replicated
(a layout choice, never a change in the numbers). `create_sharded` builds a module with
its Variables born sharded.
"""

import contextlib
import contextvars
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_ACTIVE = contextvars.ContextVar("ling2_mesh_rules", default=None)

MESH_AXES = ("data", "fsdp", "expert", "tensor")


def mesh_shape(cfg, num_devices: int) -> tuple[int, ...]:
    """The (data, fsdp, expert, tensor) sizes from cfg.ici_*_parallelism; one -1 fills the rest."""
    sizes = [getattr(cfg, f"ici_{a}_parallelism") for a in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"ici_*_parallelism: fixed sizes {sizes} do not divide {num_devices} devices")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(f"ici_*_parallelism: mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"have {num_devices}")
    return tuple(sizes)


def make_mesh(cfg, devices=None) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over `devices` (default: all)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rules_dict(rules) -> dict[str, tuple[str, ...]]:
    """cfg.logical_axis_rules ([(name, [mesh axes] | None)]) as {name: (mesh axes)}."""
    return {name: tuple(axes or ()) for name, axes in rules}


def logical_to_spec(names, shape, rules, mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims have logical `names` (None = replicated)."""
    if len(names) != len(shape):
        raise ValueError(f"logical names {names} do not match shape {shape}")
    used, out = set(), []
    for name, dim in zip(names, shape):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule in logical_axis_rules")
        axes = []
        for a in rules.get(name, ()) if name is not None else ():
            size = mesh.shape[a]
            if a in used or size == 1 or dim % (math.prod(mesh.shape[x] for x in axes) * size):
                continue
            axes.append(a)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules):
    """Within this context `constrain` shards activations on `mesh` by `rules`."""
    token = _ACTIVE.set((mesh, rules_dict(rules)))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, names):
    """with_sharding_constraint by logical names, inside `use_mesh`; identity outside."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, x.shape, rules, mesh)))


def state_shardings(state, mesh: Mesh, rules):
    """NamedShardings for an nnx.State whose Variables carry logical `out_sharding` names."""
    rules = rules_dict(rules)

    def one(v):
        names = v.get_metadata().get("out_sharding")
        if not names:
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, logical_to_spec(tuple(names), v.shape, rules, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_sharded(build, mesh: Mesh, rules):
    """Builds the module `build()` with every Variable created directly in its logical sharding
    (the full model never sits on one device). Returns the module."""
    gdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = state_shardings(abstract, mesh, rules)
    init = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)
    with use_mesh(mesh, rules):
        return nnx.merge(gdef, init())
