"""Pallas TPU and GPU kernels, run with interpret=True on CPU, against the naive recurrence.

Reference: reference.naive_recurrence (a plain per-token scan; autodiff gradients).
Forward and backward (dq, dk, dv, dg, d initial state), with packed segments, T not a
multiple of the chunk, per-token g, bf16, and head dims that are not powers of two; the GPU
kernels also split into several K and V blocks, and their stored chunk states (chunked.py's).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import gla
from ling2.kernels.gla import chunked as gla_chunked
from ling2.kernels.gla import op as gla_op
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
        if name == "dg" and dtype == jnp.bfloat16:
            np.testing.assert_array_less(np.abs(a - b), 1e-2 * _dg_terms(q, k, want[2], want[3]), err_msg=name)
            continue
        np.testing.assert_allclose(a, b, rtol=0, atol=_tol(name, rtol) * np.abs(b).max(), err_msg=name)


def _dg_terms(q, k, dq, dk):
    """Per head, sum over tokens of |q.dq| + |k.dk|: the size of the terms a per-head dg sums (q.dq - k.dk over
    the tokens). With bf16 operands their rounding is a fraction of this, however much the sum cancels."""
    f = lambda x: np.asarray(x, np.float64)
    return (np.abs(np.einsum("bthk,bthk->bth", f(q), f(dq))) + np.abs(np.einsum("bthk,bthk->bth", f(k), f(dk)))).sum((0, 1))


@pytest.mark.parametrize("dtype,sweep", [(jnp.float32, (16, 32)), (jnp.bfloat16, (16, 32)), (jnp.float32, (32, 16))])
def test_pallas_gpu_split_over_k_and_v_blocks(monkeypatch, dtype, sweep):
    """Several K and V blocks per head (sweep programs carrying state blocks, chunk kernels summing over the
    blocks) with documents that cross chunk edges and an initial state give the same numbers, also when the
    sweeps' state blocks differ from the chunk kernels' blocks (sweep: (SWEEP_BLOCK_K, SWEEP_BLOCK_V))."""
    monkeypatch.setattr(gla_pallas_gpu, "BLOCK_K", 16)
    monkeypatch.setattr(gla_pallas_gpu, "BLOCK_V", 32)
    monkeypatch.setattr(gla_pallas_gpu, "SWEEP_BLOCK_K", sweep[0])
    monkeypatch.setattr(gla_pallas_gpu, "SWEEP_BLOCK_V", sweep[1])
    jax.clear_caches()  # the module constants are read when the kernels trace
    T, K, V = 50, 48, 40  # K and V pad to 64: four K blocks of 16, two V blocks of 32
    r = np.random.default_rng(2)
    q, k = (jnp.asarray(r.standard_normal((B, T, H, K)), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
    g = -jnp.asarray(r.uniform(0, 1, (B, T, H)), jnp.float32)
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    seg = jnp.asarray([[0] * 5 + [1] * 20 + [2] * (T - 25)])  # document 1 spans the edge of chunks 0 and 1
    got = _value_and_grads(q, k, v, g, h0, seg, "pallas_gpu", 16)
    want = _value_and_grads(q, k, v, g, h0, seg, "naive", 16)
    rtol = 5e-2 if dtype == jnp.bfloat16 else 2e-5
    for name, a, b in zip(["o", "final_state", "dq", "dk", "dv", "dg", "dh0"], got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=_tol(name, rtol) * np.abs(b).max(), err_msg=name)


def test_pallas_gpu_stored_states_match_chunked():
    """The states sweep stores the state entering every chunk: chunked.py's states, in STATE_DTYPE."""
    T, K, V, C = 64, 24, 40, 16
    r = np.random.default_rng(4)
    k = jnp.asarray(r.standard_normal((B, H, T, K)), jnp.float32)
    v = jnp.asarray(r.standard_normal((B, H, T, V)), jnp.float32)
    g = -jnp.asarray(r.uniform(0, 1, (B, T, H)), jnp.float32)
    aux = gla_op.prepare_aux(g, jnp.asarray([[0] * 20 + [1] * (T - 20)]), C)  # a document starts inside chunk 1
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    want_h, want_hT = gla_chunked._states(k, v, aux, h0, C)
    L = gla_pallas_gpu._Layout(k, v, C, None, None)
    pad = gla_pallas_gpu.pad_last
    h, hT = gla_pallas_gpu._states(pad(k, L.K), pad(v, L.V), aux, h0, L, k, interpret=True)
    np.testing.assert_allclose(h[..., :K, :V], want_h, rtol=0, atol=1e-5 * np.abs(want_h).max())
    np.testing.assert_allclose(hT[..., :K, :V], want_hT, rtol=0, atol=1e-5 * np.abs(want_hT).max())
    assert h.dtype == (gla_pallas_gpu.STATE_DTYPE or k.dtype)


def test_pallas_gpu_bf16_inputs_store_states_exactly_as_bf16(monkeypatch):
    """With bf16 inputs every matmul rounds the stored states to bf16, so STATE_DTYPE None (states kept in q's
    dtype, half the memory) gives bit for bit what fp32 storage gives."""
    r = np.random.default_rng(5)
    T, K, V, C = 64, 32, 32, 16
    q, k = (jnp.asarray(r.standard_normal((B, H, T, K)), jnp.bfloat16) for _ in range(2))
    v, do = (jnp.asarray(r.standard_normal((B, H, T, V)), jnp.bfloat16) for _ in range(2))
    aux = gla_op.prepare_aux(-jnp.asarray(r.uniform(0, 1, (B, T, H)), jnp.float32), jnp.asarray([[0] * 20 + [1] * 44]),
                             C)
    h0, dhT = (jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32) for _ in range(2))
    outs = []
    for state_dtype in (jnp.float32, None):
        monkeypatch.setattr(gla_pallas_gpu, "STATE_DTYPE", state_dtype)
        outs.append(gla_pallas_gpu.forward(q, k, v, aux, h0, 0.2, C, interpret=True)
                    + gla_pallas_gpu.backward(q, k, v, aux, h0, do, dhT, 0.2, C, interpret=True))
    for name, a, b in zip(["o", "final_state", "dq", "dk", "dv", "dh0"], *outs):
        np.testing.assert_array_equal(a, b, err_msg=name)


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
    """Without interpret mode, forward and backward lower through Triton / Mosaic to their kernel calls (TPU:
    forward, dq sweep, dk/dv reverse sweep; GPU: states and outputs, then states, dstates, dv and dqdk);
    "auto" picks the kernel of the platform lowered for, here on a CPU host."""

    def loss(q, k, v, g, seg):
        o = gla.simple_gla(q, k, v, g, segment_ids=seg, backend=backend, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((2, T, 4, D), dtype)
    args = (x, x, x, jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((2, T), jnp.int32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = grad.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) == {"cuda": 6, "tpu": 3}[platform]


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
