"""Adding an attention kind is one module plus one entry in each kind table (the config's `ling2.config.kinds`,
the layers' `ling2.layers.attention.registry`): a toy linear kind registered here, and nothing else, builds a
model, counts its FLOPs and trains steps through the trainer's own step function."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config import kinds, load_config
from ling2.config.specs import WeightsSpec
from ling2.layers import model as model_lib
from ling2.layers.attention import registry
from ling2.train import step as step_lib
from ling2.train.optim import make_optimizer
from ling2.train.state import TrainState, trainable_filter
from ling2.layers.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class MeanSpec(WeightsSpec):
    """The toy kind reads only what every module with weights reads."""


class CausalMean(nnx.Module):
    """o_t = W_o mean(W_v x_s for s <= t): a toy linear-attention kind with no per-document reset."""

    def __init__(self, spec: MeanSpec, *, rngs: nnx.Rngs):
        E, wdt = spec.emb_dim, jnp.dtype(spec.weight_dtype)
        init = nnx.initializers.normal(spec.init_std)
        self.v = nnx.Param(init(rngs.params(), (E, E), wdt), out_sharding=("embed", None), eager_sharding=False)
        self.o = nnx.Param(init(rngs.params(), (E, E), wdt), out_sharding=(None, "embed"), eager_sharding=False)
        self.dtype = jnp.dtype(spec.dtype)

    def __call__(self, x_BTE, positions_BT, segment_ids_BT=None, *, layer_index=None):
        v_BTE = x_BTE.astype(self.dtype) @ self.v[...].astype(self.dtype)
        mean_BTE = jnp.cumsum(v_BTE, axis=1) / (1 + positions_BT[..., None]).astype(self.dtype)
        return mean_BTE @ self.o[...].astype(self.dtype)


def test_a_new_kind_in_one_module_and_one_entry_trains(monkeypatch):
    monkeypatch.setitem(kinds.KINDS, "mean", kinds.KindConfig(role="linear", fields=(), free_on_resume=()))
    monkeypatch.setitem(registry.ATTENTION, "mean", registry.AttentionKind(
        MeanSpec, CausalMean, matmul_params=lambda spec: 2 * spec.emb_dim ** 2,
        mixing_flops=lambda spec, seq_len: 2 * spec.emb_dim, cache=type(None), hf_params=lambda layout: [],
        packed_prefill=False))
    cfg = load_config(model_name="ling2-micro", linear_attention_type="mean", mtp_num_layers=0, vocab_size=128,
                      max_target_length=16, warmup_steps_fraction=0.0, lr_schedule="constant", learning_rate=3e-3,
                      gradient_clipping_threshold=0.0)
    assert "mean" in cfg.layer_types and kinds.FULL in cfg.layer_types
    model = model_lib.Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    assert any(isinstance(m, CausalMean) for _, m in nnx.iter_graph(model))
    assert model_lib.training_flops_per_token(ModelSpec.of(cfg), 16) > 0

    gd, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    tx, sched = make_optimizer(cfg, params)
    z = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
    state = TrainState(step=z(), params=params, rest=rest, opt_state=tx.init(params), skipped=z(), skipped_total=z())
    step = jax.jit(functools.partial(step_lib.train_step, gd, tx, cfg, lr_fn=sched))
    ids = np.random.default_rng(0).integers(0, 128, (1, 4, 17))
    batch = dict(inputs=jnp.asarray(ids[..., :-1]), targets=jnp.asarray(ids[..., 1:]),
                 positions=jnp.broadcast_to(jnp.arange(16), (1, 4, 16)), segment_ids=jnp.ones((1, 4, 16), jnp.int32),
                 loss_weights=jnp.ones((1, 4, 16), jnp.float32))
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses
