"""FP8 GEMMs (ling2.kernels.fp8) against an independent reference: numpy with ml_dtypes' float8 casts (the
OCP e4m3fn / e5m2 rounding), tile by tile and block by block in plain loops, and the products and their
gradients written out by hand (y = x w: dx = dy w^T, dw = x^T dy). Everything runs under jit, so a compiler
that dropped the f8 round trip would fail here (XLA:GPU did, before the optimization barrier: run this file
on a GPU with tools/bench/fp8/device_run.sh). Products are held to 1e-3 of their largest value: Hopper's FP8
tensor cores accumulate with fewer than fp32's bits (4e-4 seen on an H100)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from ling2.kernels import fp8
from ling2.layers.spec import ModelSpec

E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def ref_tensor(a, fmt=E4):
    """Dequantized a with one scale amax / fmt_max (numpy, float64 scale arithmetic rounded to f32)."""
    a = np.asarray(a, np.float32)
    fmax = float(ml_dtypes.finfo(fmt).max)
    s = np.float32(np.abs(a).max() / fmax)
    return np.clip(a / s, -fmax, fmax).astype(fmt).astype(np.float32) * s


def ref_tiles(a, tile=128):
    """1 x tile tiles along the last axis, each scaled alone."""
    a = np.asarray(a, np.float32)
    out = np.empty_like(a)
    for idx in np.ndindex(a.shape[:-1]):
        for j in range(0, a.shape[-1], tile):
            out[idx + (slice(j, j + tile),)] = ref_tensor(a[idx + (slice(j, j + tile),)])
    return out


def ref_blocks(w, tile=128):
    """tile x tile blocks of a [K, N] matrix, each scaled alone."""
    w = np.asarray(w, np.float32)
    out = np.empty_like(w)
    for i in range(0, w.shape[0], tile):
        for j in range(0, w.shape[1], tile):
            out[i:i + tile, j:j + tile] = ref_tensor(w[i:i + tile, j:j + tile])
    return out


def assert_rounded_alike(got, ref):
    """Equal to f32 precision, but for rare values one f8 step apart: XLA may divide by a scale as a multiply
    by its reciprocal, an ulp of f32 away, which flips a value sitting on a rounding tie."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    off = np.abs(got - ref) > 1e-5 * np.abs(ref) + 1e-30
    assert off.mean() < 1e-3, off.mean()
    assert np.all(np.abs(got - ref)[off] <= 0.13 * np.abs(ref)[off] + 1e-3 * np.abs(ref).max())


def rand(shape, seed, scale=1.0):
    r = np.random.default_rng(seed)
    # A few outliers, as activations have: per-tensor scaling then loses the small values, tiles do not.
    a = r.normal(size=shape) * scale
    a.reshape(-1)[:: 97] *= 30
    return a.astype(np.float32)


def test_quantize_tensor_matches_ml_dtypes_and_is_within_e4m3_precision():
    a = rand((64, 256), 0)
    a8, s = jax.jit(fp8.quantize_tensor)(jnp.asarray(a))
    assert a8.dtype == jnp.float8_e4m3fn and s.shape == ()
    deq = np.asarray(a8.astype(jnp.float32)) * float(s)
    assert_rounded_alike(deq, ref_tensor(a))
    big = np.abs(a) > float(s) * 2.0 ** -6 * 448  # normal e4m3 range: relative error <= 2^-4
    assert np.all(np.abs(deq - a)[big] <= 2.0 ** -4 * np.abs(a)[big])
    assert np.abs(deq).max() == pytest.approx(np.abs(a).max(), rel=1e-6)  # amax maps onto 448 exactly


def test_tiles_and_blocks_match_loops():
    a = rand((3, 5, 300), 1)  # 300: a short last tile
    assert_rounded_alike(jax.jit(fp8.qdq_tiles, static_argnums=1)(jnp.asarray(a), 1), ref_tiles(a))
    w = rand((300, 200), 2)
    got = jax.jit(lambda w: fp8.qdq_blocks(w, (), (0,), (1,)))(jnp.asarray(w))
    assert_rounded_alike(got, ref_blocks(w))
    # A [N, K] layout (k axis second) and a batch (expert) axis: blocks of each expert's [K, N].
    wb = rand((2, 200, 300), 3)  # [E, N, K]
    got = jax.jit(lambda w: fp8.qdq_blocks(w, (0,), (2,), (1,)))(jnp.asarray(wb))
    for e in range(2):
        assert_rounded_alike(np.asarray(got[e]).T, ref_blocks(wb[e].T))


def test_einsum_axes():
    ax = fp8.einsum_axes("bthd,hde->bte")
    assert (ax.x_k, ax.w_batch, ax.w_k, ax.w_n, ax.y_n) == (2, (), (0, 1), (2,), 1)
    ax = fp8.einsum_axes("nbd,ndf->nbf")
    assert (ax.x_k, ax.w_batch, ax.w_k, ax.w_n, ax.y_n) == (1, (0,), (1,), (2,), 1)
    with pytest.raises(ValueError, match="must contract the last axes"):
        fp8.einsum_axes("btd,bd->t")


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_einsum_forward_and_gradients_against_hand_products(scaling):
    M, K, N = 48, 256, 160
    x, w, dy = rand((M, K), 4), rand((K, N), 5, 0.05), rand((M, N), 6, 1e-3)
    q = fp8.Fp8(scaling)

    def f(x, w):
        return fp8.einsum("mk,kn->mn", x, w, q)

    y, vjp = jax.vjp(jax.jit(f), jnp.asarray(x), jnp.asarray(w))
    dx, dw = jax.jit(vjp)(jnp.asarray(dy))
    if scaling == "tensor":
        xq, wq, gq = ref_tensor(x), ref_tensor(w), ref_tensor(dy, E5)
    else:
        xq, wq, gq = ref_tiles(x), ref_blocks(w), ref_tiles(dy)
    for got, ref in ((y, xq @ wq), (dx, gq @ wq.T), (dw, xq.T @ gq)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
    # and FP8 really rounded: the unquantized product differs by more than float error
    assert np.abs(np.asarray(y) - x @ w).max() > 1e-2 * np.abs(x @ w).max()


def test_bf16_operands_round_under_jit():
    """bf16 in, bf16 out: XLA must not fold the bf16 -> f8 -> bf16 round trip away."""
    x, w = jnp.asarray(rand((32, 128), 7), jnp.bfloat16), jnp.asarray(rand((128, 64), 8, 0.1), jnp.bfloat16)
    y = jax.jit(lambda x, w: fp8.einsum("mk,kn->mn", x, w, fp8.Fp8("tensor")))(x, w)
    ref = ref_tensor(np.asarray(x, np.float32)) @ ref_tensor(np.asarray(w, np.float32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    plain = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert np.abs(ref - plain).max() > 5 * np.abs(np.asarray(y, np.float32) - ref).max()


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_ragged_dot_per_group_against_hand_products(scaling):
    gs = np.array([40, 0, 70, 18], np.int32)  # rows past the sum (M = 140) give zeros
    x, w, dy = rand((140, 128), 9), rand((4, 128, 96), 10, 0.05), rand((140, 96), 11, 1e-3)
    q = fp8.Fp8(scaling)
    f = jax.jit(lambda x, w: fp8.ragged_dot(x, w, jnp.asarray(gs), q))
    y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = jax.jit(vjp)(jnp.asarray(dy))
    if scaling == "tensor":
        xq, gq = ref_tensor(x), ref_tensor(dy, E5)
        wq = ref_tensor(w)  # one scale over all experts
    else:
        xq, gq = ref_tiles(x), ref_tiles(dy)
        wq = np.stack([ref_blocks(w[e]) for e in range(4)])
    ends = np.cumsum(gs)
    y_ref, dx_ref, dw_ref = np.zeros((140, 96), np.float32), np.zeros_like(x), np.zeros_like(w)
    for e in range(4):
        r = slice(ends[e] - gs[e], ends[e])
        y_ref[r] = xq[r] @ wq[e]
        dx_ref[r] = gq[r] @ wq[e].T
        dw_ref[e] = xq[r].T @ gq[r]
    for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_model_with_fp8_trains_its_projections_and_experts_in_fp8():
    """A ling2-micro forward/backward with quantization=fp8: finite, close to the unquantized one, and
    different from it (the GEMMs really ran quantized)."""
    from ling2.config import loader
    from ling2.layers.model import Ling2Model

    def loss_of(**kw):
        cfg = loader.load_config(model_name="ling2-micro", dtype="float32", **kw)
        model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
        ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)), jnp.int32)

        def loss(m):
            logits = m(ids).logits
            return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1) - jnp.take_along_axis(
                logits.astype(jnp.float32), ids[..., None], -1)[..., 0])

        g = nnx.grad(loss)(model)
        return float(loss(model)), g

    base, g0 = loss_of()
    for kw in ({"fp8_scaling": "tensor"}, {"fp8_scaling": "block"},
               {"fp8_scaling": "tensor", "moe_gmm_backend": "pallas_gpu"}):  # the float8 Triton kernels, interpreted
        val, g = loss_of(quantization="fp8", **kw)
        assert np.isfinite(val) and val != base and abs(val - base) < 0.02 * abs(base), kw
        leaves0, leaves = jax.tree.leaves(g0), jax.tree.leaves(g)
        assert all(np.all(np.isfinite(np.asarray(a))) for a in leaves)
        assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves0, leaves))
