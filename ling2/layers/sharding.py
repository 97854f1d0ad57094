"""Logical axis names -> mesh axes, by the rules in `cfg.logical_axis_rules`.

Parameters carry logical names in their `out_sharding` metadata (e.g. ("embed", "heads",
"kv")); activations are constrained with `constrain(x, names)`. Outside `use_mesh`
constraints are no-ops, so layers run unchanged on one device. A mesh axis is used at
most once per array and only on a dim it divides; otherwise that dim is replicated
(a layout choice, never a change in the numbers). Building meshes and parameter shardings
is the trainer runtime's (`ling2.train.runtime`).
"""

import contextlib
import contextvars
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_ACTIVE = contextvars.ContextVar("ling2_mesh_rules", default=None)


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


def dim_shards(name: str, size: int) -> int:
    """How many ways a dim of logical `name` and `size` is split inside `use_mesh`; 1 outside."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, rules = active
    axes = logical_to_spec((name,), (size,), rules, mesh)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def constrain(x, names):
    """with_sharding_constraint by logical names, inside `use_mesh`; identity outside."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, x.shape, rules, mesh)))
