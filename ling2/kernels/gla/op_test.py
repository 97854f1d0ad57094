"""Chunked simple GLA against its oracles, fla-core's naive torch op, the decode step and packing.

Independent references: the per-token recurrence and the quadratic T x T form written in
reference.py (autodiff gives their gradients), and flash-linear-attention's
`naive_recurrent_simple_gla` (PyPI fla-core, torch).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import gla
from ling2.kernels.testing import fla_reference

B, H, K, V, C = 2, 2, 16, 24, 16
_gla = jax.jit(gla.simple_gla, static_argnames=("chunk_size", "backend", "return_final_state"))
_step = jax.jit(gla.simple_gla_step)


def _inputs(T, *, seed=0, per_token=False, slope=None, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.standard_normal((B, T, H, K)), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
    if per_token:
        g = -jnp.asarray(r.uniform(0.0, 1.5, (B, T, H)), jnp.float32)
    else:
        g = -jnp.asarray([0.05, 0.7] if slope is None else [slope, slope / 2], jnp.float32)
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    return q, k, v, g, h0


@functools.partial(jax.jit, static_argnames=("backend",))
def _value_and_grads(q, k, v, g, h0, seg, backend):
    """Output, final state and gradients of a loss touching both, wrt q, k, v, g, h0."""

    def loss(q, k, v, g, h0):
        o, hT = gla.simple_gla(q, k, v, g, segment_ids=seg, initial_state=h0, chunk_size=C, backend=backend,
                               return_final_state=True)
        o32 = o.astype(jnp.float32)
        return jnp.sum(o32 * jnp.cos(o32)) + 0.3 * jnp.sum(hT * jnp.sin(hT)), (o, hT)

    (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, h0)
    return aux + grads


def _close(got, want, rtol):
    """Each array within rtol of the reference's largest magnitude."""
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dh0"]
    for name, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)), f"{name} not finite"
        np.testing.assert_allclose(a, b, rtol=0, atol=_tol(name, rtol) * max(np.abs(b).max(), 1e-6), err_msg=name)


SEGMENTS = np.array([[0] * 9 + [1] + [2] * 27, [5] * 20 + [3] * 17])  # a segment of length 1; ids not sorted

def _tol(name, rtol):
    """dg sums q.dq - k.dk over all later tokens (the fla identity), which cancels heavily in fp32."""
    return max(rtol, 1e-3) if name == "dg" else rtol


CASES = {
    "T_not_multiple": dict(T=37),
    "segments": dict(T=37, seg=SEGMENTS),
    "strong_decay": dict(T=37, slope=8.0, seg=SEGMENTS),
    "per_token_g": dict(T=37, per_token=True, seg=SEGMENTS),
    "bf16": dict(T=37, dtype=jnp.bfloat16, seg=SEGMENTS),
}


@pytest.mark.parametrize("case", CASES)
def test_chunked_and_quadratic_match_naive(case):
    cfg = dict(CASES[case])
    seg = cfg.pop("seg", None)
    seg = None if seg is None else jnp.asarray(seg)
    args = _inputs(**cfg)
    want = _value_and_grads(*args, seg, "naive")
    rtol = 2e-2 if cfg.get("dtype") == jnp.bfloat16 else 2e-5
    _close(_value_and_grads(*args, seg, "chunked"), want, rtol)
    _close(_value_and_grads(*args, seg, "quadratic"), want, max(rtol, 1e-4))


def test_naive_oracle_matches_fla_recurrent():
    q, k, v, g, h0 = _inputs(37, per_token=True)
    o, hT = gla.simple_gla(q, k, v, g, initial_state=h0, backend="naive", return_final_state=True)
    o_ref, hT_ref = fla_reference.recurrent(q, k, v, g, h0)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(hT, hT_ref, rtol=1e-5, atol=1e-5)


def test_chunked_matches_fla_recurrent_d128():
    T, D = 70, 128
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.standard_normal((1, T, 2, D)), jnp.float32) for _ in range(3))
    g = -jnp.asarray([0.7071, 0.5], jnp.float32)
    o, hT = gla.simple_gla(q, k, v, g, return_final_state=True)  # auto = chunked on CPU, chunk 64
    o_ref, hT_ref = fla_reference.recurrent(q, k, v, np.broadcast_to(g, (1, T, 2)))
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(hT, hT_ref, rtol=1e-4, atol=1e-4)


def test_strong_decay_long_gives_finite_gradients():
    q, k, v, g, h0 = _inputs(200, slope=8.0)
    out = _value_and_grads(q, k, v, g * 4.0, h0, None, "chunked")  # slope 32: e^{-b} would overflow
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in out)


def test_decode_steps_equal_chunked():
    q, k, v, g, h0 = _inputs(21, per_token=True)
    seg = jnp.asarray(SEGMENTS[:, :21])
    o, hT = _gla(q, k, v, g, segment_ids=seg, initial_state=h0, chunk_size=C, return_final_state=True)
    state, outs = h0, []
    for t in range(q.shape[1]):
        reset = seg[:, t] != seg[:, max(t - 1, 0)]
        o_t, state = _step(state, q[:, t], k[:, t], v[:, t], g[:, t], reset=reset)
        outs.append(o_t)
    np.testing.assert_allclose(jnp.stack(outs, 1), o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, hT, rtol=1e-5, atol=1e-5)


def test_decode_step_per_head_g():
    q, k, v, g, h0 = _inputs(3)
    o, hT = _gla(q, k, v, g, initial_state=h0, return_final_state=True)
    state = h0
    for t in range(3):
        o_t, state = _step(state, q[:, t], k[:, t], v[:, t], g)
    np.testing.assert_allclose(o_t, o[:, -1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, hT, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["chunked", "naive"])
def test_packing_isolation(backend):
    """Two documents packed in one row give what each gives alone (state reset, no leak)."""
    q, k, v, g, _ = _inputs(40)
    cut = 23  # not a chunk boundary
    seg = jnp.asarray([[1] * cut + [2] * (40 - cut)] * B)
    packed = _gla(q, k, v, g, segment_ids=seg, chunk_size=C, backend=backend)
    first = _gla(q[:, :cut], k[:, :cut], v[:, :cut], g, chunk_size=C, backend=backend)
    second = _gla(q[:, cut:], k[:, cut:], v[:, cut:], g, chunk_size=C, backend=backend)
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], 1), rtol=1e-6, atol=1e-6)
    leaky = _gla(q, k, v, g, chunk_size=C, backend=backend)
    assert not np.allclose(leaky[:, cut:], second, atol=1e-3)  # without ids the second doc does see the first


def test_auto_backend_per_platform():
    assert [gla.resolve_backend("auto", p) for p in ("cpu", "tpu", "cuda", "rocm")] == [
        "chunked", "pallas_tpu", "pallas_gpu", "chunked"]
    assert gla.resolve_backend("auto", "cuda", chunk_size=24) == "chunked"  # Triton needs a power of two
    assert gla.resolve_backend("naive", "tpu") == "naive"
    with pytest.raises(ValueError, match="backend='flash'"):
        gla.resolve_backend("flash", "cpu")


def test_bad_input_errors():
    q, k, v, g, h0 = _inputs(8)
    with pytest.raises(ValueError, match="g must be"):
        gla.simple_gla(q, k, v, g[:1])
    with pytest.raises(ValueError, match="segment_ids"):
        gla.simple_gla(q, k, v, g, segment_ids=jnp.zeros((B, 7), jnp.int32))
    with pytest.raises(ValueError, match="initial_state"):
        gla.simple_gla(q, k, v, g, initial_state=h0[..., :3])
    with pytest.raises(ValueError, match="chunk_size"):
        gla.simple_gla(q, k, v, g, chunk_size=12)
    with pytest.raises(ValueError, match="backend"):
        gla.simple_gla(q, k, v, g, backend="cuda")
    with pytest.raises(ValueError, match="expected q, k"):
        gla.simple_gla(q, k[..., :8], v, g)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: run under Bazel (devices = 4)")
def test_inside_shard_map_per_head_g_gradient_is_summed_over_batch_shards():
    """Per-head g is replicated over the batch shards; its gradient must add every shard's part."""
    from jax.sharding import PartitionSpec as P

    q, k, v, g, h0 = _inputs(21)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    x_spec = P("data", None, "tensor", None)

    def loss(q, k, v, g, h0, sharded):
        f = lambda q, k, v, g, h0: gla.simple_gla(q, k, v, g, initial_state=h0, chunk_size=C)
        if sharded:
            f = jax.shard_map(f, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, P("tensor"), P("data", "tensor")),
                              out_specs=x_spec)
        return jnp.sum(jnp.sin(f(q, k, v, g, h0)))

    grads = [jax.jit(jax.grad(loss, argnums=(0, 3, 4)), static_argnums=5)(q, k, v, g, h0, s) for s in (False, True)]
    for a, b in zip(grads[1], grads[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
