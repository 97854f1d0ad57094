"""RMSNorm and GroupRMSNorm against numpy written here (float64)."""

import jax.numpy as jnp
import numpy as np
import pytest

from ling2.layers import norms


def _np_group_rms(x, w, groups, eps):
    x = x.astype(np.float64)
    xs = x.reshape(*x.shape[:-1], groups, -1)
    y = xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + eps)
    return y.reshape(x.shape) * w


@pytest.mark.parametrize("groups", [1, 4])
def test_group_rms_norm_matches_numpy(groups):
    r = np.random.default_rng(groups)
    x = r.standard_normal((2, 3, 64)).astype(np.float32) * np.linspace(0.1, 10, 64, dtype=np.float32)
    w = r.uniform(0.5, 1.5, 64).astype(np.float32)
    m = norms.GroupRMSNorm(64, groups, eps=1e-6)
    m.weight[...] = jnp.asarray(w)
    np.testing.assert_allclose(m(jnp.asarray(x)), _np_group_rms(x, w, groups, 1e-6), rtol=1e-5, atol=1e-6)


def test_groups_are_independent():
    """With 4 groups, scaling one group's inputs leaves the other groups' outputs unchanged."""
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    w = np.ones(64, np.float32)
    y = norms.group_rms_norm(jnp.asarray(x), w, 4, 1e-6)
    x2 = x.copy()
    x2[:, :16] *= 100.0
    y2 = norms.group_rms_norm(jnp.asarray(x2), w, 4, 1e-6)
    np.testing.assert_allclose(y2[:, 16:], y[:, 16:], rtol=1e-6)
    assert not np.allclose(norms.group_rms_norm(jnp.asarray(x2), w, 1, 1e-6)[:, 16:], y[:, 16:])


def test_rms_norm_matches_numpy_and_keeps_dtype():
    r = np.random.default_rng(7)
    x = r.standard_normal((4, 32)).astype(np.float32)
    w = r.uniform(0.5, 1.5, 32).astype(np.float32)
    m = norms.RMSNorm(32, eps=1e-6)
    m.weight[...] = jnp.asarray(w)
    np.testing.assert_allclose(m(jnp.asarray(x)), _np_group_rms(x, w, 1, 1e-6), rtol=1e-5, atol=1e-6)
    y = m(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), _np_group_rms(x, w, 1, 1e-6), rtol=2e-2, atol=2e-2)


def test_bad_group_count_raises():
    with pytest.raises(ValueError, match="group_norm_size"):
        norms.GroupRMSNorm(64, 3, eps=1e-6)
