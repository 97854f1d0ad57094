"""cross_entropy_sums against a float64 numpy log-softmax written out here."""

import jax.numpy as jnp
import numpy as np

from ling2.layers import losses


def test_cross_entropy_sums_against_numpy():
    r = np.random.default_rng(1)
    logits = r.normal(size=(2, 3, 5)).astype(np.float32)
    tgt = r.integers(0, 5, (2, 3))
    w = np.array([[1, 0, 1], [1, 1, 0]], np.float32)
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x).sum(-1))
    ref = ((lse - np.take_along_axis(x, tgt[..., None], -1)[..., 0]) * w).sum()
    hits = ((x.argmax(-1) == tgt) * w).sum()
    ce, n, h = losses.cross_entropy_sums(jnp.asarray(logits), jnp.asarray(tgt), jnp.asarray(w))
    np.testing.assert_allclose(float(ce), ref, rtol=1e-5)
    assert float(n) == 4 and float(h) == hits
