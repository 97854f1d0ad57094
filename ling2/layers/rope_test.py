"""Partial NeoX (rotate-half) RoPE against a per-pair rotation written in numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from ling2.layers import rope


def test_matches_pairwise_rotation():
    B, T, H, D, R, theta = 2, 5, 3, 12, 8, 500.0
    r = np.random.default_rng(0)
    x = r.standard_normal((B, T, H, D)).astype(np.float32)
    pos = r.integers(0, 1000, (B, T))
    want = x.astype(np.float64).copy()
    for j in range(R // 2):  # dim j rotates with dim j + R/2 by angle pos * theta^(-2j/R)
        a = pos[..., None] * theta ** (-2.0 * j / R)
        x1, x2 = x[..., j].astype(np.float64), x[..., j + R // 2].astype(np.float64)
        want[..., j] = x1 * np.cos(a) - x2 * np.sin(a)
        want[..., j + R // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    got = rope.apply_rotary(jnp.asarray(x), jnp.asarray(pos), R, theta)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got)[..., R:], x[..., R:])  # unrotated dims pass through


def test_scores_depend_on_relative_position_only():
    r = np.random.default_rng(1)
    q, k = (jnp.asarray(r.standard_normal((1, 1, 1, 16)), jnp.float32) for _ in range(2))
    score = lambda m, n: float(jnp.sum(rope.apply_rotary(q, jnp.array([[m]]), 16) * rope.apply_rotary(
        k, jnp.array([[n]]), 16)))
    np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-4)
    assert abs(score(7, 3) - score(7, 4)) > 1e-3


def test_inv_freq_override_and_scaling():
    x = jnp.ones((1, 2, 1, 4))
    pos = jnp.array([[0, 1]])
    got = rope.apply_rotary(x, pos, 4, inv_freq=np.array([0.5, 0.25]), scaling=2.0)
    np.testing.assert_allclose(got[0, 0, 0], [2.0, 2.0, 2.0, 2.0], rtol=1e-6)  # position 0: cos = 1, sin = 0
    c, s = 2 * np.cos([0.5, 0.25]), 2 * np.sin([0.5, 0.25])
    np.testing.assert_allclose(got[0, 1, 0], np.concatenate([c - s, c + s]), rtol=1e-6)


def test_bad_rotary_dim_raises():
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.apply_rotary(jnp.ones((1, 1, 1, 4)), jnp.zeros((1, 1)), 6)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.apply_rotary(jnp.ones((1, 1, 1, 4)), jnp.zeros((1, 1)), 3)
