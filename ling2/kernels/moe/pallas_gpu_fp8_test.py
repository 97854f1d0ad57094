"""The Pallas GPU grouped SwiGLU with FP8 GEMMs (`grouped_swiglu_fp8`), interpreted on the CPU, against a numpy
reference written from the recipe alone (ling2.kernels.fp8's per-tensor mode): each operand rounded to e4m3 or
e5m2 by ml_dtypes' casts at one scale per tensor (amax / the format's largest value, divided in float32; gate and
up jointly), the products of the dequantized values in float64 per expert. Forward and all four gradients."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ling2.kernels import fp8
from ling2.kernels.moe import gmm, pallas_gpu

E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _q(arrays, fmt):
    """float64 dequantized copies of `arrays` under one per-tensor scale, and the scale (float32 arithmetic)."""
    amax = max(np.float32(np.abs(a.astype(np.float32)).max()) for a in arrays)
    fmax = np.float32(ml_dtypes.finfo(fmt).max)
    s = np.float32(amax / fmax) if amax > 0 else np.float32(1)
    return [np.clip(a.astype(np.float32) / s, -fmax, fmax).astype(fmt).astype(np.float64) for a in arrays], float(s)


def _per_group(gs, f, M, P):
    out, start = np.zeros((M, P)), 0
    for g, n in enumerate(gs):
        out[start:start + n] = f(g, slice(start, start + n))
        start += n
    return out


def _reference(x, gs, wg, wu, wd, dy, dt):
    """(y, dx, dwg, dwu, dwd) with the roundings where the kernels make them: gate, up, h, dh and the outputs in
    the rows' dtype `dt`, h and x in e4m3, dy and the gate/up gradients in e5m2."""
    rnd = lambda a: np.asarray(a).astype(dt).astype(np.float64)  # noqa: E731
    M, F = x.shape[0], wg.shape[2]
    (x8,), sx = _q([x], E4)
    (wg8, wu8), sgu = _q([wg, wu], E4)
    (wd8,), sd = _q([wd], E4)
    gate = _per_group(gs, lambda g, r: x8[r] @ wg8[g], M, F) * (sx * sgu)
    up = _per_group(gs, lambda g, r: x8[r] @ wu8[g], M, F) * (sx * sgu)
    h = rnd(gate / (1 + np.exp(-gate)) * up)
    (h8,), sh = _q([h], E4)
    y = rnd(_per_group(gs, lambda g, r: h8[r] @ wd8[g], M, wd.shape[2]) * (sh * sd))
    (g8,), sg = _q([dy], E5)
    dh = rnd(_per_group(gs, lambda g, r: g8[r] @ wd8[g].T, M, F) * (sg * sd))
    gate, up = rnd(gate), rnd(up)
    sig = 1 / (1 + np.exp(-gate))
    (dg8, du8), sdgu = _q([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], E5)
    dx = rnd(_per_group(gs, lambda g, r: dg8[r] @ wg8[g].T + du8[r] @ wu8[g].T, M, x.shape[1]) * (sdgu * sgu))
    starts = np.concatenate([[0], np.cumsum(gs)[:-1]])
    wgrad = lambda a, b, s: np.stack([a[o:o + n].T @ b[o:o + n] for o, n in zip(starts, gs)]) * s  # noqa: E731
    return y, dx, wgrad(x8, dg8, sx * sdgu), wgrad(x8, du8, sx * sdgu), wgrad(h8, g8, sh * sg)


def _case(seed, M, D, F, sizes):
    r = np.random.default_rng(seed)
    E = len(sizes)
    return (r.standard_normal((M, D)).astype(np.float32), np.asarray(sizes, np.int32),
            (0.3 * r.standard_normal((E, D, F))).astype(np.float32), r.standard_normal((E, D, F)).astype(np.float32),
            (2.0 * r.standard_normal((E, F, D))).astype(np.float32), r.standard_normal((M, D)).astype(np.float32))


# (M, D, F, group sizes): rows past the groups, an empty group, widths that are not multiples of 32
CASES = [(300, 64, 96, [70, 0, 130, 1, 60]), (130, 40, 24, [0, 128, 2])]


@pytest.mark.parametrize("M,D,F,sizes", CASES)
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_fp8_swiglu_matches_the_recipe(M, D, F, sizes, dt):
    x, gs, wg, wu, wd, dy = _case(0, M, D, F, sizes)
    jdt = jnp.dtype(dt)

    def loss(x, wg, wu, wd):
        y = pallas_gpu.grouped_swiglu_fp8(x, jnp.asarray(gs), wg, wu, wd, interpret=True)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    (_, y), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(
        jnp.asarray(x, jdt), jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd))
    want = _reference(np.asarray(jnp.asarray(x, jdt).astype(jnp.float32)), gs, wg, wu, wd,
                      np.asarray(jnp.asarray(dy, jdt).astype(jnp.float32)) if dt == "bfloat16" else dy,
                      np.dtype(jdt))
    assert y.dtype == jdt and grads[0].dtype == jdt and all(g.dtype == jnp.float32 for g in grads[1:])
    # fp32 sums against float64 ones: a value on a float8 rounding boundary may round the other way, so the bound
    # is relative to the largest entry, far below one float8 step (6% in e4m3) of the output
    tol = 2e-5 if dt == "float32" else 1e-2
    for name, got, ref in zip(("y", "dx", "dwg", "dwu", "dwd"), (y, *grads), want):
        err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
        assert err < tol, (name, err)
    assert not np.asarray(y[sum(sizes):]).any() and not np.asarray(grads[0][sum(sizes):]).any()


def test_fp8_differs_from_bf16_by_the_rounding():
    """The float8 result is not the unquantized one (the roundings happen): its error against float64 products
    of the unrounded operands is of the order of e4m3's step, far above the recipe check's bound."""
    x, gs, wg, wu, wd, _ = _case(1, *CASES[0][:3], CASES[0][3])
    y = pallas_gpu.grouped_swiglu_fp8(jnp.asarray(x), jnp.asarray(gs), jnp.asarray(wg), jnp.asarray(wu),
                                      jnp.asarray(wd), interpret=True)
    exact = pallas_gpu.grouped_swiglu(jnp.asarray(x), jnp.asarray(gs), jnp.asarray(wg), jnp.asarray(wu),
                                      jnp.asarray(wd), interpret=True)
    err = float(jnp.abs(y - exact).max() / jnp.abs(exact).max())
    assert 1e-3 < err < 0.1


def test_grouped_ffn_takes_the_kernel_for_tensor_scaling_only():
    x, gs, wg, wu, wd, _ = _case(2, 256, 32, 32, [100, 156])
    args = (jnp.asarray(x), jnp.asarray(gs), (jnp.asarray(wg), jnp.asarray(wu), jnp.asarray(wd)), "pallas_gpu")
    direct = pallas_gpu.grouped_swiglu_fp8(*args[:2], *args[2], interpret=True)
    np.testing.assert_array_equal(gmm.grouped_ffn(*args, q=fp8.Fp8("tensor"), interpret=True), direct)
    with pytest.raises(ValueError, match="block"):
        gmm.grouped_ffn(*args, q=fp8.Fp8("block"), interpret=True)
