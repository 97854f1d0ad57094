"""The train state: what it holds, its shardings, and building it abstractly or for real.

`abstract_state` traces the model and optimizer with `jax.eval_shape` only, so a plan of any
size (the real 16B model included) costs no memory: it is what `--dry_run` and the compile
tool lower against, and what a run builds once to restore into or initialise. `init_state`
materialises that state, each parameter born in its sharding (the full model never sits on
one device).
"""

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from ling2.checkpoint.state import load_into
from ling2.layers.model import Ling2Model
from ling2.layers.moe.router import RoutedBias
from ling2.layers.spec import ModelSpec
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


class TrainSetup(NamedTuple):
    """What a run trains with: the model's structure, the optimizer, its schedule and the state
    (of ShapeDtypeStructs carrying their shardings from `abstract_state`)."""
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    schedule: Callable  # optimizer update count -> learning rate
    state: TrainState


def fields(state: TrainState) -> dict:
    """The state as a dict of its fields (what a checkpoint stores)."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def trainable_filter(cfg):
    return nnx.Any(nnx.Param, RoutedBias) if cfg.enable_routed_bias_grad else nnx.Param


def _build(cfg, mesh, seed: int):
    model = Ling2Model(ModelSpec.of(cfg, mesh), rngs=nnx.Rngs(seed))
    return nnx.split(model, trainable_filter(cfg), ...)


def _counters(mesh):
    """Three int32 zeros, distinct buffers (the step donates its state), replicated over the mesh."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return [jax.device_put(jnp.zeros((), jnp.int32), replicated, may_alias=False) for _ in range(3)]


def abstract_state(cfg, mesh) -> TrainSetup:
    """The TrainSetup of `cfg` on `mesh`, its state ShapeDtypeStructs carrying their shardings.

    Optimizer state per parameter (Adam's moments: optax rebuilds the params' Variables, names
    included) is sharded as its parameter; counters are replicated."""
    gd, params, rest = jax.eval_shape(functools.partial(_build, cfg, mesh, cfg.seed))
    tx, sched = make_optimizer(cfg, params)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = _with_shardings(params, state_shardings(params, mesh, cfg.logical_axis_rules))
    rest = _with_shardings(rest, state_shardings(rest, mesh, cfg.logical_axis_rules))
    opt = jax.eval_shape(tx.init, params)
    opt = _with_shardings(opt, state_shardings(opt, mesh, cfg.logical_axis_rules))
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = TrainState(step=scalar, params=params, rest=rest, opt_state=opt, skipped=scalar, skipped_total=scalar)
    return TrainSetup(graphdef=gd, tx=tx, schedule=sched, state=state)


def _with_shardings(tree, shardings):
    """`tree`'s ShapeDtypeStructs carrying `shardings` (a tree with one sharding per array of `tree`, in
    order; Variables may be nodes or leaves there)."""
    leaves, treedef = jax.tree.flatten(tree)
    sh = jax.tree.leaves(shardings)
    if len(sh) != len(leaves):
        raise ValueError(f"{len(sh)} shardings for {len(leaves)} arrays")
    return treedef.unflatten([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, sh)])


def init_state(cfg, mesh, setup: TrainSetup) -> TrainState:
    """`setup.state` built for real from cfg.seed, each array in its sharding."""
    abstract = setup.state
    shardings = jax.tree.map(lambda x: x.sharding, (abstract.params, abstract.rest))

    @functools.partial(jax.jit, out_shardings=shardings)
    def make():
        _, p, r = _build(cfg, mesh, cfg.seed)
        return p, r

    with jax.set_mesh(mesh):
        params, rest = make()
    opt_state = jax.jit(setup.tx.init, out_shardings=jax.tree.map(lambda x: x.sharding, abstract.opt_state))(params)
    step, skipped, skipped_total = _counters(mesh)
    return TrainState(step=step, params=params, rest=rest, opt_state=opt_state, skipped=skipped,
                      skipped_total=skipped_total)


def load_parameters(cfg, setup: TrainSetup, state: TrainState) -> TrainState:
    """`state` with cfg.load_parameters_path's weights (same shardings) and a fresh optimizer state."""
    model = nnx.merge(setup.graphdef, state.params, state.rest)
    shardings = jax.tree.map(lambda x: x.sharding, (state.params, state.rest))
    load_into(model, cfg.load_parameters_path, cfg)
    _, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    params, rest = jax.device_put((params, rest), shardings)
    opt_state = jax.jit(setup.tx.init, out_shardings=jax.tree.map(lambda x: x.sharding, state.opt_state))(params)
    return state.replace(params=params, rest=rest, opt_state=opt_state)
