"""The train state: what it holds, its shardings, and building it abstractly or for real.

`abstract_state` traces the model and optimizer with `jax.eval_shape` only, so a plan of any
size (the real 16B model included) costs no memory: it is what `--dry_run` and the compile
tool lower against. `init_state` materialises the same state, each parameter born in its
sharding (the full model never sits on one device).
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from ling2.checkpoint.state import load_into
from ling2.layers.model import Ling2Model
from ling2.layers.moe_router import RoutedBias
from ling2.layers.sharding import use_mesh
from ling2.train.optim import make_optimizer
from ling2.train.runtime import state_shardings


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any  # trainable nnx.State
    rest: Any  # everything else (expert biases when they take no gradient)
    opt_state: Any
    skipped: jax.Array  # consecutive non-finite steps
    skipped_total: jax.Array


def fields(state: TrainState) -> dict:
    """The state as a dict of its fields (what a checkpoint stores)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def trainable_filter(cfg):
    return nnx.Any(nnx.Param, RoutedBias) if cfg.enable_routed_bias_grad else nnx.Param


def _build(cfg, seed: int):
    model = Ling2Model(cfg, rngs=nnx.Rngs(seed))
    return nnx.split(model, trainable_filter(cfg), ...)


def _counters(mesh):
    """Three int32 zeros, distinct buffers (the step donates its state), replicated over the mesh."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return [jax.device_put(jnp.zeros((), jnp.int32), replicated, may_alias=False) for _ in range(3)]


def abstract_state(cfg, mesh, seed: Optional[int] = None):
    """(graphdef, optimizer, lr schedule, TrainState of ShapeDtypeStructs carrying their shardings).

    Optimizer-state shardings are what XLA gives `tx.init` of the sharded params (as `init_state`
    computes it), counters replicated."""
    seed = cfg.seed if seed is None else seed
    gd, params, rest = jax.eval_shape(functools.partial(_build, cfg, seed))
    tx, sched = make_optimizer(cfg, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = _with_shardings(params, state_shardings(params, mesh, cfg.logical_axis_rules))
    rest = _with_shardings(rest, state_shardings(rest, mesh, cfg.logical_axis_rules))
    init = jax.jit(tx.init).lower(params).compile()
    opt_shardings = jax.tree.map(lambda s: s if isinstance(s, NamedSharding) else replicated, init.output_shardings)
    opt = _with_shardings(jax.eval_shape(tx.init, params), opt_shardings)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return gd, tx, sched, TrainState(step=scalar, params=params, rest=rest, opt_state=opt, skipped=scalar,
                                     skipped_total=scalar)


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree`'s leaves with the shardings of `shardings`' leaves, in leaf order
    (`state_shardings` puts a sharding where a Variable was, so the two trees differ in nodes)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                        for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True)])


def init_state(cfg, mesh, seed: Optional[int] = None):
    """(graphdef, optimizer, lr schedule, TrainState) built for real, sharded on `mesh`."""
    seed = cfg.seed if seed is None else seed
    gd, tx, sched, abstract = abstract_state(cfg, mesh, seed)
    shardings = jax.tree.map(lambda x: x.sharding, (abstract.params, abstract.rest))

    @functools.partial(jax.jit, out_shardings=shardings)
    def make():
        _, p, r = _build(cfg, seed)
        return p, r

    with use_mesh(mesh, cfg.logical_axis_rules):
        params, rest = make()
    opt_state = jax.jit(tx.init)(params)
    step, skipped, skipped_total = _counters(mesh)
    # optax's count comes out on one device: replicate it over the mesh, or a state restored
    # across processes lands on devices the step's other inputs do not share.
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding)
                             else jax.device_put(x, replicated, may_alias=False), opt_state)
    state = TrainState(step=step, params=params, rest=rest, opt_state=opt_state, skipped=skipped,
                       skipped_total=skipped_total)
    return gd, tx, sched, state


def load_parameters(cfg, gd, state: TrainState, tx) -> TrainState:
    """Replaces the initial weights with a checkpoint's (same shardings); fresh optimizer state."""
    model = nnx.merge(gd, state.params, state.rest)
    shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.rest))
    load_into(model, cfg.load_parameters_path, cfg)
    _, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    params, rest = jax.device_put((params, rest), shardings)
    return state.replace(params=params, rest=rest, opt_state=jax.jit(tx.init)(params))
