"""Pipeline parallelism: the scanned layer groups split over the mesh's "stage" axis, on GPipe's schedule.

With S the stage axis's size, the n scanned groups (stacked on the "layers" axis, which the "layers"
rule puts on "stage") form S stages of n / S consecutive groups, stage s on stage shard s. A batch of
B rows splits into P = run.pipeline_microbatches micro-batches of B / P rows. At step i of P + S - 1,
stage s runs micro-batch i - s through its groups (when 0 <= i - s < P) and hands the result to stage
s + 1 (`ppermute`): stage 0 reads micro-batch i from the input, the last stage's results are the output.
Autodiff runs the same schedule backwards (the reverse permutation carries the cotangents), each layer
under its own remat policy. Every stage computes at every step, idle ones on values that are masked out:
the bubble is (S - 1) / (P + S - 1) of the pipelined layers' time.

A stage's code runs in `shard_map`, manual over "stage" and over the batch axes that split a micro-batch's
rows (`row_axes`): each device runs its own rows, as data parallelism does, and `ling2.layers.sharding`
counts those axes as size 1 inside. A stage's weights enter as stored and are all-gathered once, whole but
for their expert and tensor-parallel dims, and held for every micro-batch. Each device sums their gradients
over the micro-batches locally; they are reduce-scattered across devices once, after the schedule
(Megatron-LM's pipeline with a distributed optimizer): the P + S - 1 steps gather no weight and reduce no
gradient, and only activations cross stages. (Left to XLA, a per-step gradient all-reduce inside the loop
is what its while-loop all-reduce code motion hoists, by materialising a zero constant the size of the
stage's gradients on the compiling host.) With `pipeline_weights_dtype` (bfloat16) a stage gathers and
holds its floating Params in that dtype and sums their gradients over the micro-batches in it; the
reduce-scatter runs in the weights' own dtype. Outputs equal the unpipelined scan's row for row; each
layer's auxiliary outputs are summed over the micro-batches and the row shards (`parts` of them).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from ling2.layers.sharding import constrain, dim_axes, dim_shards, mesh_of, spec

AXIS = "stage"
KEPT = ("exp", "heads", "mlp", "vocab")  # logical dims a stage's weights stay split along


def stages(run) -> int:
    """The stage axis's size under `run` (a RunSpec); 1 without a pipeline."""
    return dict(run.mesh_shape).get(AXIS, 1)


def check(num_groups: int, rows: int, run) -> None:
    """ValueError naming the setting when `num_groups` scanned groups of a `rows`-row batch cannot be pipelined."""
    S, P = stages(run), run.pipeline_microbatches
    if num_groups % S:
        raise ValueError(f"ici_stage_parallelism: {S} stages do not divide the {num_groups} scanned layer groups")
    if rows % P:
        raise ValueError(f"pipeline_microbatches: {P} does not divide the {rows} rows of a micro-batch")


def row_axes(run, rows: int) -> tuple[str, ...]:
    """The mesh axes besides "stage" that split a micro-batch of `rows` rows (the activation_batch rule's)."""
    return dim_axes(run, "activation_batch", rows, manual=(AXIS,))


def parts(run, batch: int) -> int:
    """Over how many (micro-batch, row shard) parts a `batch`-row pipeline sums each layer's auxiliary outputs."""
    P = run.pipeline_microbatches
    sizes = dict(run.mesh_shape)
    return P * math.prod(sizes[a] for a in row_axes(run, batch // P))


def _stored(v, run, manual) -> tuple:
    """(in_spec, gathers) of a stacked state `v`: the `manual` axes each dim is stored split over (the leading
    groups dim over "stage"), and the (dim, axes) it is gathered along inside a stage (all but the `KEPT` dims)."""
    names = tuple(v.get_metadata().get("out_sharding") or ())
    names = ("layers", *names) if len(names) == v.ndim - 1 else names
    if len(names) != v.ndim:
        return PartitionSpec(AXIS), ()
    axes = [(ax,) if isinstance(ax, str) else tuple(ax or ()) for ax in spec(names, v.shape, run)]
    axes = [(AXIS,)] + [tuple(a for a in ax if a in manual and a != AXIS) for ax in axes[1:]]
    gathers = tuple((d, ax) for d, (n, ax) in enumerate(zip(names, axes)) if d and ax and n not in KEPT)
    return PartitionSpec(*(ax or None for ax in axes)), gathers


def _gather(x, gathers, dtype):
    """`x` (a stage's block of a weight) all-gathered along `gathers` ((dim, mesh axes) pairs), in `dtype` (None:
    its own); its gradient reduce-scattered back, in x's dtype (so a bfloat16 copy's gradients are summed
    across devices in float32)."""
    def gather(x):
        for d, axes in gathers:
            x = jax.lax.all_gather(x, axes, axis=d, tiled=True)
        return x

    if dtype is None or jnp.dtype(dtype) == x.dtype:
        return gather(x)
    own = x.dtype

    def scatter(_, ct):
        ct = ct.astype(own)
        for d, axes in reversed(gathers):
            ct = jax.lax.psum_scatter(ct, axes, scatter_dimension=d, tiled=True)
        return (ct,)

    cast = jax.custom_vjp(lambda x: gather(x.astype(dtype)))
    cast.defvjp(lambda x: (cast(x), None), scatter)
    return cast(x)


def resident(state, run):
    """`state` (Variables named by their logical axes) constrained to be whole but along its `KEPT` dims."""
    def one(v):
        names = v.get_metadata().get("out_sharding")
        if not names:
            return v
        return v.replace(value=constrain(v[...], tuple(n if n in KEPT else None for n in names), run))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def pipeline(group_fn, stacked, x_BTE, extras, *, run):
    """(x [B,T,E], aux) after every scanned group: what `lax.scan(group_fn)` over the stack gives, pipelined.

    group_fn(state, g, x_bTE, extras_b) -> (x_bTE, aux) runs group g (its global index, traced) on b rows;
    `stacked`: the groups' state, leading axis n; `extras`: a pytree of [B, ...] arrays read per row
    (positions, segment ids), split with x. aux: group_fn's aux stacked over the n groups, each summed over
    the micro-batches."""
    S, P = stages(run), run.pipeline_microbatches
    B = x_BTE.shape[0]
    n = jax.tree.leaves(stacked)[0].shape[0]
    check(n, B, run)
    G = n // S
    split, join = _micro_layout(B, P, run)
    x_PbTE, extras_P = split(x_BTE), jax.tree.map(split, extras)
    rows = row_axes(run, B // P)
    manual = frozenset({AXIS, *rows})
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves, tree = jax.tree.flatten(stacked, is_leaf=is_var)
    entry = [_stored(v, run, manual) for v in leaves]
    cast = [run.pipeline_weights_dtype or None if isinstance(v, nnx.Param) and jnp.issubdtype(v.dtype, jnp.floating)
            else None for v in leaves]

    def per_stage(local, x_PbTE, extras_P):
        s = jax.lax.axis_index(AXIS)
        held = [v.replace(value=_gather(v[...], gathers, dtype))
                for v, (_, gathers), dtype in zip(jax.tree.leaves(local, is_leaf=is_var), entry, cast)]
        local = resident(jax.tree.unflatten(tree, held), run)

        def stage_fn(x, ex):
            def body(x, xs):
                state, g = xs
                return group_fn(state, s * G + g, x, ex)
            return jax.lax.scan(body, x, (local, jnp.arange(G, dtype=jnp.int32)))

        aux_shape = jax.eval_shape(stage_fn, x_PbTE[0], jax.tree.map(lambda e: e[0], extras_P))[1]

        def step(carry, i):
            held, aux = carry
            m = i - s
            live = (m >= 0) & (m < P)
            x = jnp.where(s == 0, x_PbTE[jnp.minimum(i, P - 1)], held)
            y, a = stage_fn(x, jax.tree.map(lambda e: e[jnp.clip(m, 0, P - 1)], extras_P))
            aux = jax.tree.map(lambda acc, v: acc + jnp.where(live, v, jnp.zeros_like(v)), aux, a)
            held = jax.lax.ppermute(y, AXIS, [(j, j + 1) for j in range(S - 1)])
            return (held, aux), y

        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape)
        (_, aux), ys = jax.lax.scan(step, (jnp.zeros_like(x_PbTE[0]), zeros), jnp.arange(P + S - 1, dtype=jnp.int32))
        if rows:
            aux = jax.tree.map(lambda a: jax.lax.psum(a, rows), aux)
        return ys[None, S - 1:], aux  # the last stage's are micro-batches 0..P-1

    weights = jax.tree.unflatten(tree, [in_spec for in_spec, _ in entry])
    by_row = PartitionSpec(None, rows or None)
    out, aux = jax.shard_map(
        per_stage, mesh=mesh_of(run), axis_names=manual, check_vma=False,
        in_specs=(weights, by_row, by_row),
        out_specs=(PartitionSpec(AXIS, None, rows or None), PartitionSpec(AXIS)))(stacked, x_PbTE, extras_P)
    return join(out[S - 1]), aux


def _micro_layout(B: int, P: int, run):
    """(split, join): [B, ...] rows <-> [P, B / P, ...] micro-batches, in the order that keeps each device's rows
    local. Outside the pipeline B splits over the stage axis and then D devices (L rows each); micro-batch
    (s, q) takes, from every one of stage s's D devices, its rows q*r .. q*r + r - 1 (r = S L / P). Entering the
    stages is then one all-gather over "stage", and no device ever holds all B rows; any other B and P take
    consecutive rows (the same numbers, the layout left to the compiler)."""
    S = stages(run)
    axes = dim_axes(run, "activation_batch", B)
    S_b = S if AXIS in axes else 1
    D = dim_shards(run, "activation_batch", B) // S_b
    L = B // (S_b * D)
    r = S_b * L // P if P % S_b == 0 else 0
    if not r or L % r or r * P != S_b * L:
        return (lambda a: a.reshape(P, B // P, *a.shape[1:])), (lambda a: a.reshape(B, *a.shape[2:]))

    def split(a):
        rest = a.shape[1:]
        a = a.reshape(S_b, D, L // r, r, *rest).transpose(0, 2, 1, 3, *range(4, 4 + len(rest)))
        return a.reshape(P, D * r, *rest)

    def join(a):
        rest = a.shape[2:]
        a = a.reshape(S_b, L // r, D, r, *rest).transpose(0, 2, 1, 3, *range(4, 4 + len(rest)))
        return a.reshape(B, *rest)

    return split, join
