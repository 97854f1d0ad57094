"""Pallas TPU and GPU kernels, run with interpret=True on CPU, against the naive recurrence.

Reference: reference.naive_recurrence (a plain per-token scan; autodiff gradients).
Forward and backward (dq, dk, dv, dg, d initial state), with packed segments, T not a
multiple of the chunk, per-token g, bf16, and head dims that are not powers of two.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import gla
from ling2.kernels.gla import pallas_gpu as gla_pallas_gpu

B, H = 1, 2


@functools.partial(jax.jit, static_argnames=("backend", "C"))
def _value_and_grads(q, k, v, g, h0, seg, backend, C):
    def loss(q, k, v, g, h0):
        o, hT = gla.simple_gla(q, k, v, g, segment_ids=seg, initial_state=h0, chunk_size=C, backend=backend,
                               return_final_state=True, interpret=True)
        o32 = o.astype(jnp.float32)
        return jnp.sum(o32 * jnp.cos(o32)) + 0.3 * jnp.sum(hT * jnp.sin(hT)), (o, hT)

    (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, h0)
    return aux + grads


def _tol(name, rtol):
    """dg sums q.dq - k.dk over all later tokens (the fla identity), which cancels heavily in fp32."""
    return max(rtol, 1e-3) if name == "dg" else rtol


CASES = {
    # name: (T, K, V, chunk, per-token g, dtype)
    "segments_T_ragged": (45, 16, 16, 16, False, jnp.float32),
    "per_token_g_odd_dims": (40, 24, 40, 16, True, jnp.float32),
    "bf16": (33, 16, 32, 16, False, jnp.bfloat16),
}


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("case", CASES)
def test_pallas_interpret_matches_naive(backend, case):
    T, K, V, C, per_token, dtype = CASES[case]
    r = np.random.default_rng(1)
    q, k = (jnp.asarray(r.standard_normal((B, T, H, K)), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
    g = -jnp.asarray(r.uniform(0, 2, (B, T, H)) if per_token else [0.3, 8.0], jnp.float32)
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    seg = jnp.asarray([[0] * 16 + [1] + [2] * (T - 17)])  # a boundary on a chunk edge, a 1-token segment
    got = _value_and_grads(q, k, v, g, h0, seg, backend, C)
    want = _value_and_grads(q, k, v, g, h0, seg, "naive", C)
    # bf16: the kernels feed the fp32 state and the decayed scores to the MXU / tensor cores as bf16
    # (fla's convention), so gradients carry about 2-3% of bf16 rounding relative to their largest entry.
    rtol = 5e-2 if dtype == jnp.bfloat16 else 2e-5
    for name, a, b in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dh0"], got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=0, atol=_tol(name, rtol) * np.abs(b).max(), err_msg=name)


def test_pallas_gpu_split_over_v_blocks(monkeypatch):
    """Several V blocks per head (partial dq, dk summed outside) give the same numbers."""
    monkeypatch.setattr(gla_pallas_gpu, "BLOCK_V", 16)
    T, K, V = 24, 16, 48  # V pads to 64: four blocks of 16
    r = np.random.default_rng(2)
    q, k = (jnp.asarray(r.standard_normal((B, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, V)), jnp.float32)
    g = -jnp.asarray(r.uniform(0, 2, (B, T, H)), jnp.float32)
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    seg = jnp.asarray([[0] * 5 + [1] * (T - 5)])
    got = _value_and_grads(q, k, v, g, h0, seg, "pallas_gpu", 16)
    want = _value_and_grads(q, k, v, g, h0, seg, "naive", 16)
    for name, a, b in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dh0"], got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=_tol(name, 2e-5) * np.abs(b).max(), err_msg=name)


def test_pallas_gpu_rejects_non_power_of_two_chunk():
    x = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="power of two"):
        gla.simple_gla(x, x, x, jnp.zeros((1,)), chunk_size=24, backend="pallas_gpu", interpret=True)


@pytest.mark.parametrize("backend, platform, marker", [("pallas_gpu", "cuda", "custom_call @__gpu$xla.gpu.triton"),
                                                       ("pallas_tpu", "tpu", "custom_call @tpu_custom_call"),
                                                       ("auto", "cuda", "custom_call @__gpu$xla.gpu.triton"),
                                                       ("auto", "tpu", "custom_call @tpu_custom_call")])
@pytest.mark.parametrize("T, D, dtype", [(1088, 128, jnp.bfloat16), (100, 24, jnp.float32)])
def test_kernels_lower_for_real_hardware(backend, platform, marker, T, D, dtype):
    """Without interpret mode, forward and backward lower through Triton / Mosaic to three kernel calls;
    "auto" picks the kernel of the platform lowered for, here on a CPU host."""

    def loss(q, k, v, g, seg):
        o = gla.simple_gla(q, k, v, g, segment_ids=seg, backend=backend, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((2, T, 4, D), dtype)
    args = (x, x, x, jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((2, T), jnp.int32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = grad.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == 3  # forward, dq sweep, dk/dv reverse sweep


def test_auto_runs_the_chunked_backend_on_cpu():
    """Bit for bit the chunked backend's values and gradients (interpreted Pallas rounds differently)."""
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.standard_normal((B, 50, H, 24)), jnp.float32) for _ in range(3))
    g, h0 = -jnp.asarray([0.3, 2.0]), jnp.asarray(r.standard_normal((B, H, 24, 24)), jnp.float32)
    seg = jnp.asarray([[0] * 20 + [1] * 30])
    auto = _value_and_grads(q, k, v, g, h0, seg, "auto", 16)
    chunked = _value_and_grads(q, k, v, g, h0, seg, "chunked", 16)
    for a, b in zip(auto, chunked):
        np.testing.assert_array_equal(a, b)
