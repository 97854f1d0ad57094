"""How values vary over the mesh inside `shard_map` (check_vma), for the kernels that run in it."""

import jax


def vary_like(x, like):
    """Inside shard_map, mark x as varying over every mesh axis `like` varies over (so its
    cotangent, which does, type-checks; autodiff turns this into a psum). No-op elsewhere."""
    axes = getattr(jax.typeof(like), "manual_axis_type", None)
    have = getattr(jax.typeof(x), "manual_axis_type", None)
    if axes is None or have is None:
        return x
    extra = tuple(sorted(axes.varying - have.varying))
    return jax.lax.pcast(x, extra, to="varying") if extra else x


def sum_like(x, like):
    """Inside shard_map, x summed over the mesh axes it varies over and `like` does not: the cotangent of an
    input replicated over them (a custom VJP must return it so). No-op elsewhere."""
    axes = getattr(jax.typeof(like), "manual_axis_type", None)
    have = getattr(jax.typeof(x), "manual_axis_type", None)
    if axes is None or have is None:
        return x
    extra = tuple(sorted(have.varying - axes.varying))
    return jax.lax.psum(x, extra) if extra else x


def out_struct(shape, dtype, like):
    """Shape of a Pallas kernel output that varies over the mesh axes `like` varies over
    (pallas_call needs this under shard_map with check_vma; ignored elsewhere)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=getattr(jax.typeof(like), "manual_axis_type", None))
