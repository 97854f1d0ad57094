"""The Pallas GPU grouped matmul, interpreted on the CPU, against a per-group numpy product (float64) and
against `jax.lax.ragged_dot` (values and gradients, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels.moe import pallas_gpu

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


def _numpy_swiglu(x, gs, wg, wu, wd):
    y = np.zeros((x.shape[0], wd.shape[2]))
    start = 0
    for g, n in enumerate(gs):
        xs = x[start:start + n].astype(np.float64)
        a, b = xs @ wg[g].astype(np.float64), xs @ wu[g].astype(np.float64)
        y[start:start + n] = (a / (1 + np.exp(-a)) * b) @ wd[g].astype(np.float64)
        start += n
    return y


@pytest.mark.parametrize("M,D,F,sizes", [(300, 32, 48, [70, 0, 130, 1, 99]), (257, 24, 40, [0, 200, 0, 7, 0]),
                                         (400, 48, 16, [3, 5, 0, 250, 60, 0])])
def test_grouped_swiglu_against_numpy_and_ragged_dot_gradients(M, D, F, sizes):
    """The fused gate/up kernel plus the down gmm against a float64 per-group SwiGLU; its VJP (transposed gmms, the
    two-pair dx kernel, the two-output and the plain tgmm) against autodiff of the same SwiGLU by jax.lax.ragged_dot."""
    r = np.random.default_rng(5)
    gs = np.asarray(sizes, np.int32)
    x = r.standard_normal((M, D)).astype(np.float32)
    wg, wu = (r.standard_normal((len(sizes), D, F)).astype(np.float32) for _ in range(2))
    wd = r.standard_normal((len(sizes), F, D)).astype(np.float32)
    dy = r.standard_normal((M, D)).astype(np.float32)
    args = tuple(map(jnp.asarray, (x, wg, wu, wd)))
    ours = lambda x, wg, wu, wd: pallas_gpu.grouped_swiglu(x, jnp.asarray(gs), wg, wu, wd, interpret=True)

    def ref(x, wg, wu, wd):
        mm = lambda a, w: jax.lax.ragged_dot(a, w, jnp.asarray(gs))
        return mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)

    np.testing.assert_allclose(np.asarray(ours(*args)), _numpy_swiglu(x, gs, wg, wu, wd), rtol=1e-4, atol=1e-3)
    grads = [jax.grad(lambda *a: jnp.sum(f(*a) * dy), argnums=(0, 1, 2, 3))(*args) for f in (ours, ref)]
    for name, a, b in zip(("dx", "dwg", "dwu", "dwd"), *grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3, err_msg=name)


def test_gmm_sums_several_pairs_in_one_kernel(monkeypatch):
    """gmm(x0, w0, more=((x1, w1),)) = x0 @ w0[g] + x1 @ w1[g] per group, transposed weights as the dx kernel
    uses them; the pairs' steps share one loop (two steps of 16 here), so their shapes must match."""
    monkeypatch.setattr(pallas_gpu, "GMM_TILES", (128, 128, 16))
    r = np.random.default_rng(6)
    gs = np.asarray([50, 0, 120, 86], np.int32)
    x0, x1 = (r.standard_normal((256, 32)).astype(np.float32) for _ in range(2))
    w0, w1 = (r.standard_normal((4, 48, 32)).astype(np.float32) for _ in range(2))
    y = pallas_gpu.gmm(jnp.asarray(x0), jnp.asarray(w0), jnp.asarray(gs), transpose_rhs=True, interpret=True,
                       more=((jnp.asarray(x1), jnp.asarray(w1)),))
    want = _numpy_gmm(x0, w0, gs, True) + _numpy_gmm(x1, w1, gs, True)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"every pair must have x \(256, 32\)"):
        pallas_gpu.gmm(jnp.asarray(x0), jnp.asarray(w0), jnp.asarray(gs), transpose_rhs=True, interpret=True,
                       more=((jnp.asarray(x1[:, :16]), jnp.asarray(w1[..., :16])),))
