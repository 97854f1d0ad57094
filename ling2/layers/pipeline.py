"""Pipeline parallelism: the scanned layer groups split over the mesh's "stage" axis, on GPipe's schedule.

With S the stage axis's size, the n scanned groups (stacked on the "layers" axis, which the "layers"
rule puts on "stage") form S stages of n / S consecutive groups, stage s on stage shard s. A batch of
B rows splits into P = run.pipeline_microbatches micro-batches of B / P rows. At step i of P + S - 1,
stage s runs micro-batch i - s through its groups (when 0 <= i - s < P) and hands the result to stage
s + 1 (`ppermute`): stage 0 reads micro-batch i from the input, the last stage's results are the output.
Autodiff runs the same schedule backwards (the reverse permutation carries the cotangents), each layer
under its own remat policy. Every stage computes at every step, idle ones on values that are masked out:
the bubble is (S - 1) / (P + S - 1) of the pipelined layers' time.

A stage's code runs in `shard_map`, manual over "stage" only. Inside it `ling2.layers.sharding` counts
"stage" as size 1, so a stage's activations split over the other batch axes as they would without a
pipeline. Its weights are gathered once, on entry, whole but for their expert and tensor-parallel dims,
and held for every micro-batch, their gradients reduce-scattered once (Megatron-LM's pipeline with a
distributed optimizer): the schedule's P + S - 1 steps gather no weight, and only activations cross stages.
Outputs equal the unpipelined scan's row for row; each layer's auxiliary outputs are summed over the
micro-batches.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from ling2.layers.sharding import constrain, dim_axes, dim_shards, mesh_of

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

    def per_stage(local, x_PbTE, extras_P):
        s = jax.lax.axis_index(AXIS)
        local = resident(local, run)

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
        return ys[None, S - 1:], aux  # the last stage's are micro-batches 0..P-1

    by_stage = PartitionSpec(AXIS)
    out, aux = jax.shard_map(
        per_stage, mesh=mesh_of(run), axis_names=frozenset({AXIS}), check_vma=False,
        in_specs=(by_stage, PartitionSpec(), PartitionSpec()),
        out_specs=(by_stage, by_stage))(stacked, x_PbTE, extras_P)
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
