"""Logical axis names -> mesh axes, by the rules in `cfg.logical_axis_rules`.

Parameters carry logical names in their `out_sharding` metadata (e.g. ("embed", "heads",
"kv")); activations are constrained with `constrain(x, names, run)`. A layer learns the mesh from
its spec's `run` (`ling2.config.specs.RunSpec`): the mesh's axis sizes and the rules, handed down
from the model's construction. With no mesh there (one device) constraints are no-ops, so layers
run unchanged. A mesh axis is used at most once per array and only on a dim it divides; otherwise
that dim is replicated (a layout choice, never a change in the numbers). Inside a `shard_map` manual over
some axes (the pipeline's "stage"), those axes count as size 1: each shard's code splits only over the
rest. The devices are the
ambient `jax.set_mesh`'s, which must be the mesh the run was built for. Building meshes and parameter
shardings is the trainer runtime's (`ling2.train.runtime`).
"""

import math

import jax
from jax.sharding import Mesh, PartitionSpec


def rules_dict(rules) -> dict[str, tuple[str, ...]]:
    """cfg.logical_axis_rules ([(name, [mesh axes] | None)]) as {name: (mesh axes)}."""
    return {name: tuple(axes or ()) for name, axes in rules}


def logical_to_spec(names, shape, rules, mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims have logical `names` (None = replicated)."""
    if len(names) != len(shape):
        raise ValueError(f"logical names {names} do not match shape {shape}")
    return _spec(names, shape, rules, dict(mesh.shape))


def _spec(names, shape, rules, sizes: dict) -> PartitionSpec:
    used, out = set(), []
    for name, dim in zip(names, shape):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule in logical_axis_rules")
        axes = []
        for a in rules.get(name, ()) if name is not None else ():
            size = sizes.get(a, 1)  # an axis this mesh lacks: size 1
            if a in used or size == 1 or dim % (math.prod(sizes[x] for x in axes) * size):
                continue
            axes.append(a)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def _split_sizes(sizes, mesh) -> dict:
    """{mesh axis: size} of `sizes` ((axis, size) pairs), the axes `mesh` is manual over (inside `shard_map`)
    counted as 1: the code traced there splits only over the others."""
    manual = frozenset(getattr(mesh, "manual_axes", ())) if not mesh.empty else frozenset()
    return {a: 1 if a in manual else n for a, n in sizes}


def _sizes(run, manual=()) -> dict:
    """`_split_sizes` of `run`'s mesh under the ambient one, the axes in `manual` counted as 1 too."""
    sizes = _split_sizes(run.mesh_shape, jax.sharding.get_abstract_mesh())
    return {a: 1 if a in manual else n for a, n in sizes.items()}


def _split(run, name: str, size: int, manual=()) -> tuple:
    """(mesh sizes, mesh axes a dim of logical `name` and `size` splits over) under `run`."""
    sizes = _sizes(run, manual)
    if not sizes:
        return sizes, ()
    axes = _spec((name,), (size,), rules_dict(run.logical_axis_rules), sizes)[0]
    return sizes, () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def dim_axes(run, name: str, size: int, manual=()) -> tuple[str, ...]:
    """The mesh axes a dim of logical `name` and `size` is split over under `run` (a RunSpec), in order; the
    axes in `manual` count as size 1, as inside a `shard_map` manual over them."""
    return _split(run, name, size, manual)[1]


def spec(names, shape, run) -> PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dims have logical `names`, under `run` (a RunSpec)."""
    return _spec(names, shape, rules_dict(run.logical_axis_rules), _sizes(run))


def dim_shards(run, name: str, size: int) -> int:
    """How many ways a dim of logical `name` and `size` is split under `run`; 1 on one device."""
    sizes, axes = _split(run, name, size)
    return math.prod(sizes[a] for a in axes)


def context_axes(run, length: int, what: str):
    """The mesh axis name (or tuple of names) a sequence of `length` positions is split over under `run`
    (the activation_length rule: context parallelism), None when it is whole. `what` names the caller in
    the error raised when the rule maps to mesh axes that do not divide `length` evenly."""
    sizes, axes = _split(run, "activation_length", length)
    want = tuple(a for a in rules_dict(run.logical_axis_rules).get("activation_length", ()) if sizes.get(a, 1) > 1)
    if axes != want:
        raise ValueError(f"{what}: the sequence of {length} positions does not split over the context axes "
                         f"{dict((a, sizes[a]) for a in want)} (it must be a multiple of their product)")
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
        sizes = _split_sizes(dict(m.shape).items(), m)
        axes = {}
        for names, x in zip(in_names, args):
            if isinstance(names, PartitionSpec) or not isinstance(names, tuple):
                continue
            if len(names) != len(x.shape):
                raise ValueError(f"logical names {names} do not match shape {x.shape}")
            for name, ax in zip(names, _spec(names, x.shape, r, sizes)):
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


def mesh_of(run):
    """The ambient mesh (`jax.set_mesh`), checked to be the one `run` (a RunSpec) was made for."""
    sizes, ambient = dict(run.mesh_shape), jax.sharding.get_abstract_mesh()
    if ambient.empty or dict(ambient.shape) != sizes:
        raise ValueError(f"a layer built for the mesh {sizes} runs under "
                         f"{'no mesh' if ambient.empty else dict(ambient.shape)}: call it inside jax.set_mesh of "
                         "the mesh its spec was made with (ModelSpec.of(cfg, mesh))")
    return ambient


def shard_map_for(run, f, in_names, out_names):
    """`shard_map_by_names(f, in_names, out_names, run's rules)` on the mesh `run` (a RunSpec) was made
    for; f itself on one device."""
    if not run.mesh_shape:
        return f
    return shard_map_by_names(f, in_names, out_names, run.logical_axis_rules, mesh=mesh_of(run))


def constrain(x, names, run):
    """with_sharding_constraint of `x` by logical `names` under `run` (a RunSpec); identity on one device.
    Raises ValueError when the ambient mesh (`jax.set_mesh`) is not the one `run` was made for."""
    if not run.mesh_shape:
        return x
    mesh_of(run)
    return jax.lax.with_sharding_constraint(x, spec(names, x.shape, run))
