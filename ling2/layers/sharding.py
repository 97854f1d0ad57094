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
            size = mesh.shape.get(a, 1)  # an axis this mesh lacks: size 1
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


def dim_axes(name: str, size: int) -> tuple[str, ...]:
    """The mesh axes a dim of logical `name` and `size` is split over inside `use_mesh` (in order); () outside."""
    active = _ACTIVE.get()
    if active is None:
        return ()
    mesh, rules = active
    axes = logical_to_spec((name,), (size,), rules, mesh)[0]
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def dim_shards(name: str, size: int) -> int:
    """How many ways a dim of logical `name` and `size` is split inside `use_mesh`; 1 outside."""
    active = _ACTIVE.get()
    return 1 if active is None else math.prod(active[0].shape[a] for a in dim_axes(name, size))


def context_axes(length: int, what: str):
    """The mesh axis name (or tuple of names) a sequence of `length` positions is split over inside
    `use_mesh` (the activation_length rule: context parallelism), None when it is whole. `what` names the
    caller in the error raised when the rule maps to mesh axes that do not divide `length` evenly."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    want = tuple(a for a in rules.get("activation_length", ()) if mesh.shape.get(a, 1) > 1)
    axes = dim_axes("activation_length", length)
    if axes != want:
        raise ValueError(f"{what}: the sequence of {length} positions does not split over the context axes "
                         f"{dict((a, mesh.shape[a]) for a in want)} (it must be a multiple of their product)")
    return None if not axes else axes[0] if len(axes) == 1 else axes


def shard_map_by_names(f, in_names, out_names, rules, *, mesh=None):
    """f run per device in `jax.shard_map` over `mesh` (default: the ambient one), every argument and output
    split by its logical axis names through `rules` (cfg.logical_axis_rules or `rules_dict`'s form): one tuple
    per array, e.g. ("activation_batch", None, "activation_heads", None), or a PartitionSpec of mesh axes
    taken as is (or, for a pytree argument, a pytree of PartitionSpecs). out_names is one entry (f returns an array) or a tuple of them (f returns a tuple). A name
    splits the same way wherever it appears (decided on the arguments, whose dims must agree). Without a
    mesh, or on one device, f itself. check_vma=False: Pallas kernels inside cannot state how their outputs
    vary over the mesh; an argument replicated over split axes has its gradient summed over them by
    shard_map's transpose."""

    def call(*args):
        m = jax.sharding.get_abstract_mesh() if mesh is None else mesh
        if m.empty or m.size == 1:
            return f(*args)
        r = rules if isinstance(rules, dict) else rules_dict(rules)
        axes = {}
        for names, x in zip(in_names, args):
            if isinstance(names, PartitionSpec) or not isinstance(names, tuple):
                continue
            for name, ax in zip(names, logical_to_spec(names, x.shape, r, m)):
                if name is not None and axes.setdefault(name, ax) != ax:
                    raise ValueError(f"shard_map_by_names: logical axis {name!r} splits as {axes[name]} on one "
                                     f"argument and {ax} on another (dims of different sizes)")

        def spec(names):
            if isinstance(names, PartitionSpec) or not isinstance(names, tuple):
                return names
            return PartitionSpec(*(None if n is None else axes[n] for n in names))

        several = all(isinstance(n, (tuple, PartitionSpec)) for n in out_names)
        out_specs = tuple(spec(n) for n in out_names) if several else spec(out_names)
        return jax.shard_map(f, mesh=m, in_specs=tuple(spec(n) for n in in_names), out_specs=out_specs,
                             check_vma=False)(*args)

    return call


def constrain(x, names):
    """with_sharding_constraint by logical names, inside `use_mesh`; identity outside."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, x.shape, rules, mesh)))
