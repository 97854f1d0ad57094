"""Learning-rate schedules and the weight-decay mask, against hand-computed values."""

import math

import numpy as np
import pytest
from flax import nnx

from ling2.checkpoint import state as ckpt_state
from ling2.checkpoint.state import flat, unflat
from ling2.config import load_config
from ling2.layers.model import abstract_model
from ling2.train.optim import decay_mask, lr_schedule
from ling2.train.state import trainable_filter
from ling2.layers.spec import ModelSpec


def test_warmup_then_cosine():
    cfg = load_config(steps=100, learning_rate=1.0, warmup_steps_fraction=0.1, final_lr_fraction=0.1,
                      lr_schedule="cosine")
    f = lr_schedule(cfg)
    assert float(f(0)) == 0.0
    np.testing.assert_allclose(float(f(5)), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(f(10)), 1.0, rtol=1e-6)
    # cosine from 1.0 to 0.1 over the remaining 90 steps: halfway -> 0.1 + 0.9 * 0.5
    np.testing.assert_allclose(float(f(55)), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)), rtol=1e-5)
    np.testing.assert_allclose(float(f(100)), 0.1, rtol=1e-5)


def test_wsd():
    cfg = load_config(steps=100, learning_rate=2.0, warmup_steps_fraction=0.1, final_lr_fraction=0.0,
                      wsd_decay_steps_fraction=0.2, lr_schedule="wsd")
    f = lr_schedule(cfg)
    assert float(f(50)) == 2.0 and float(f(80)) == 2.0  # stable until the last 20 steps
    np.testing.assert_allclose(float(f(90)), 1.0, rtol=1e-6)  # linear decay 80 -> 100
    np.testing.assert_allclose(float(f(100)), 0.0, atol=1e-7)


def test_wsm_is_warmup_then_constant_past_the_end():
    """wsm never decays (the merge of checkpoints stands in for the decay): the rate stays at its peak past
    `steps`, so a run can be extended."""
    cfg = load_config(steps=100, learning_rate=2.0, warmup_steps_fraction=0.1, final_lr_fraction=0.0,
                      lr_schedule="wsm")
    f = lr_schedule(cfg)
    np.testing.assert_allclose(float(f(5)), 1.0, rtol=1e-6)
    assert float(f(10)) == float(f(100)) == float(f(1000)) == 2.0


def _mask_leaves(cfg) -> dict:
    """{path: bool} of the decay mask over the real model's trainable state."""
    _, params, _ = nnx.split(abstract_model(ModelSpec.of(cfg)), trainable_filter(cfg), ...)
    mask = decay_mask(nnx.to_pure_dict(params), cfg)
    return {tuple(map(str, p)): m for p, m in flat(mask).items()}


@pytest.mark.parametrize("embeddings", [False, True])
def test_decay_mask_by_role_is_the_same_scanned_and_unscanned(embeddings):
    """On the real ling2-tiny tree (expert bias trainable): decayed are exactly the weights whose HF name ends in
    `.weight` of a projection (names from the HF layout, independent of the roles), never a norm scale or the
    expert bias, stacked [n, D] or not; the scanned mask, moved to the unscanned layout, is the unscanned one."""
    over = dict(model_name="ling2-tiny", enable_routed_bias_grad=True, weight_decay_embeddings=embeddings)
    flat_cfg, scan_cfg = load_config(**over, scan_layers=False), load_config(**over, scan_layers=True)
    want = _mask_leaves(flat_cfg)
    norm_or_bias = lambda p: p[-1] in ("weight", "expert_bias")  # noqa: E731 - RMSNorm.weight, Router.expert_bias
    assert want == {p: (not norm_or_bias(p)) and (embeddings or p[-1] != "embedding") for p in want}
    assert sum(norm_or_bias(p) for p in want) == 56 + 10  # every norm scale and expert bias of the tiny model

    got = _mask_leaves(scan_cfg)
    shapes = {tuple(map(str, p)): v.shape for p, v in ckpt_state.model_leaves(scan_cfg).items()}
    assert any(len(shapes[p]) == 2 and p[-1] == "weight" for p in got)  # stacked [n, D] norm scales exist
    as_arrays = unflat({p: np.full(shapes[p], float(m)) for p, m in got.items()})
    moved = flat(ckpt_state.relayout(as_arrays, scan_cfg, flat_cfg))
    assert {tuple(map(str, p)): bool(np.all(v)) for p, v in moved.items() if tuple(map(str, p)) in want} == want
    assert all(np.all(v == v.flat[0]) for v in moved.values())



@pytest.mark.parametrize("mu_dtype", ["", "bfloat16"])
def test_adam_first_moment_dtype(mu_dtype):
    """mu_dtype stores Adam's first moment in bf16 (MaxText's mu_dtype) and nothing else: after one step
    from zero moments, mu = (1 - b1) g rounded to that dtype, nu = (1 - b2) g^2 in fp32, and the update
    is Adam's first, bias-corrected step -lr * g / (|g| + eps) in fp32 (hand-computed, weight decay off)."""
    import jax
    import jax.numpy as jnp
    import optax

    from ling2.train.optim import make_optimizer

    cfg = load_config(model_name="ling2-micro", steps=10, learning_rate=0.5, warmup_steps_fraction=0.0,
                      lr_schedule="constant", adam_weight_decay=0.0, gradient_clipping_threshold=0.0,
                      mu_dtype=mu_dtype)
    _, abstract, _ = nnx.split(abstract_model(ModelSpec.of(cfg)), trainable_filter(cfg), ...)
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    opt, _ = make_optimizer(cfg, params)
    updates, state = opt.update(grads, opt.init(params), params)
    adam, = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    for g, mu, nu, u in zip(*(jax.tree.leaves(t) for t in (grads, adam.mu, adam.nu, updates))):
        g = np.asarray(g)
        want_mu = ((1 - cfg.adam_b1) * g).astype(mu_dtype or "float32")
        assert mu.dtype == (mu_dtype or "float32") and nu.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(mu), want_mu)
        np.testing.assert_allclose(np.asarray(nu), (1 - cfg.adam_b2) * g**2, rtol=1e-6)
        want_u = -0.5 * g / (np.abs(g) + cfg.adam_eps)  # this step's moment is used before it is stored
        np.testing.assert_allclose(np.asarray(u), want_u, rtol=1e-5)
