"""Learning-rate schedules and the weight-decay mask, against hand-computed values."""

import math

import jax.numpy as jnp
import numpy as np

from ling2.config import load_config
from ling2.train.optim import decay_mask, lr_schedule


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


def test_decay_mask_skips_norms_biases_and_embeddings():
    params = {"embed": {"embedding": jnp.zeros((4, 2))}, "layer": {"kernel": jnp.zeros((2, 2)),
                                                                    "norm": {"scale": jnp.zeros((2,))}}}
    m = decay_mask(params, load_config(weight_decay_embeddings=False))
    assert m == {"embed": {"embedding": False}, "layer": {"kernel": True, "norm": {"scale": False}}}
    m = decay_mask(params, load_config(weight_decay_embeddings=True))
    assert m["embed"]["embedding"] is True
