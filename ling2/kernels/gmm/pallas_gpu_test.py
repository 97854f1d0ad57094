"""The Pallas GPU grouped matmul, interpreted on the CPU, against a per-group numpy product (float64) and
against `jax.lax.ragged_dot` (values and gradients, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels.gmm import pallas_gpu

jax.config.update("jax_default_matmul_precision", "highest")


def _case(seed, M, Q, P, sizes, transpose_rhs=False):
    r = np.random.default_rng(seed)
    x = r.standard_normal((M, Q)).astype(np.float32)
    w = r.standard_normal((len(sizes), P, Q) if transpose_rhs else (len(sizes), Q, P)).astype(np.float32)
    return x, w, np.asarray(sizes, np.int32)


def _numpy_gmm(x, w, gs, transpose_rhs=False):
    y = np.zeros((x.shape[0], w.shape[1] if transpose_rhs else w.shape[2]))
    start = 0
    for g, n in enumerate(gs):
        wg = w[g].astype(np.float64)
        y[start:start + n] = x[start:start + n].astype(np.float64) @ (wg.T if transpose_rhs else wg)
        start += n
    return y


# (M, Q, P, group sizes): tiles straddling groups, empty groups (first, middle, last), rows past the groups,
# dims that are not multiples of 16, a group spanning several row tiles.
CASES = [
    (300, 32, 48, [70, 0, 130, 1, 99]),
    (257, 24, 40, [0, 200, 0, 7, 0]),
    (128, 16, 16, [128]),
    (400, 48, 32, [3, 5, 0, 250, 60, 0]),
]


@pytest.mark.parametrize("M,Q,P,sizes", CASES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_matches_per_group_products(M, Q, P, sizes, transpose_rhs):
    x, w, gs = _case(0, M, Q, P, sizes, transpose_rhs)
    y = pallas_gpu.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(gs), transpose_rhs=transpose_rhs,
                                  interpret=True)
    np.testing.assert_allclose(np.asarray(y), _numpy_gmm(x, w, gs, transpose_rhs), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M,Q,P,sizes", CASES)
def test_gradients_match_ragged_dot(M, Q, P, sizes):
    x, w, gs = _case(1, M, Q, P, sizes)
    dy = np.random.default_rng(2).standard_normal((M, P)).astype(np.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * dy)

    ours = jax.grad(loss(lambda x, w: pallas_gpu.grouped_matmul(x, w, jnp.asarray(gs), interpret=True)), (0, 1))
    ref = jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, jnp.asarray(gs))), (0, 1))
    for a, b in zip(ours(jnp.asarray(x), jnp.asarray(w)), ref(jnp.asarray(x), jnp.asarray(w))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


def test_tgmm_is_the_per_group_weight_gradient():
    x, _, gs = _case(3, 384, 32, 16, [100, 0, 200, 84])
    dy = np.random.default_rng(4).standard_normal((384, 64)).astype(np.float32)
    dw = pallas_gpu.tgmm(jnp.asarray(x), jnp.asarray(dy), jnp.asarray(gs), interpret=True)
    starts = np.concatenate([[0], np.cumsum(gs)[:-1]])
    for g, (s, n) in enumerate(zip(starts, gs)):
        want = x[s:s + n].astype(np.float64).T @ dy[s:s + n]
        np.testing.assert_allclose(np.asarray(dw[g]), want, rtol=1e-5, atol=1e-4)


def test_visits_cover_every_row_once():
    gs = jnp.asarray([70, 0, 130, 1, 99], jnp.int32)
    group, tile, lo, hi = (np.asarray(a) for a in pallas_gpu.visits(gs, 512, 128))
    assert len(group) == 512 // 128 + 5
    written = np.zeros(512, int)
    for g, t, a, b in zip(group, tile, lo, hi):
        rows = np.arange(t * 128, t * 128 + 128)
        written[rows[(rows >= a) & (rows < b)]] += 1
    assert (written == 1).all()  # the groups' rows and the tail [300, 512)
    live = hi > lo
    # group 0 [0, 70): tile 0; 2 [70, 200): tiles 0-1; 3 [200, 201): tile 1; 4 [201, 300): tiles 1-2;
    # the tail (group 5) [300, 512): tiles 2-3; group 1 is empty.
    assert group[live].tolist() == [0, 2, 2, 3, 4, 4, 5, 5]
    assert tile[live].tolist() == [0, 0, 1, 1, 1, 2, 2, 3]
