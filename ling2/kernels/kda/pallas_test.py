"""KDA Pallas TPU and GPU kernels, run with interpret=True on CPU, against the naive recurrence.

Reference: reference.naive_recurrence (a plain per-token scan; autodiff gradients), which
kda_test checks against flash-linear-attention's naive KDA. Forward and backward (dq, dk, dv, dg,
dbeta, d initial state) with packed segments, T not a multiple of the chunk, gates at the -5 bound,
bf16, head dims that are not powers of two, and several V blocks per head on GPU; then lowering
without interpret mode (Mosaic / Triton kernel calls). The real Mosaic compile is
kda_tpu_compile_test (needs a TPU venv).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import kda
from ling2.kernels.kda import pallas_gpu as kda_pallas_gpu

NAMES = ("o", "hT", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(T, K, V, dtype, *, gate=(-5.0, 0.0), seed=1):
    r = np.random.default_rng(seed)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    sig = lambda x: 1 / (1 + np.exp(-x))
    q, k = (jnp.asarray(l2(r.standard_normal((1, T, 2, K))), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((1, T, 2, V)), dtype)
    g = jnp.asarray(gate[0] + (gate[1] - gate[0]) * sig(2 * r.standard_normal((1, T, 2, K))), jnp.float32)
    beta = jnp.asarray(sig(r.standard_normal((1, T, 2))), jnp.float32)
    h0 = jnp.asarray(r.standard_normal((1, 2, K, V)), jnp.float32)
    return q, k, v, g, beta, h0


@functools.partial(jax.jit, static_argnames=("backend", "C"))
def _value_and_grads(q, k, v, g, beta, h0, seg, backend, C):
    def loss(q, k, v, g, beta, h0):
        o, hT = kda.kda(q, k, v, g, beta, segment_ids=seg, initial_state=h0, chunk_size=C, backend=backend,
                        return_final_state=True, interpret=True)
        o32 = o.astype(jnp.float32)
        return jnp.sum(o32 * jnp.cos(o32)) + 0.3 * jnp.sum(hT * jnp.sin(hT)), (o, hT)

    (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True)(q, k, v, g, beta, h0)
    return aux + grads


def _check(got, want, rtol):
    """Each output within rtol of the reference's largest entry. dg is the difference of q.dq and k.dk terms
    (the gate identity), so its rounding scales with dk, not with dg (tiny when every step decays by e^-5)."""
    scale = {name: np.abs(np.asarray(b, np.float64)).max() for name, b in zip(NAMES, want)}
    scale["dg"] = max(scale["dg"], scale["dk"])
    for name, a, b in zip(NAMES, got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape and np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale[name], err_msg=name)


CASES = {
    # name: (T, K, V, chunk, gate range, dtype)
    "fp32_T_ragged_odd_dims": (45, 24, 40, 16, (-5.0, 0.0), jnp.float32),
    "bf16_gate_near_-5": (33, 16, 32, 16, (-5.0, -4.5), jnp.bfloat16),
    "fp32_four_sub_chunks": (150, 16, 24, 64, (-5.0, 0.0), jnp.float32),  # GPU prologue: off-diagonal blocks
    "fp32_unbounded_gate": (80, 16, 16, 32, (-80.0, -20.0), jnp.float32),
}


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("case", CASES)
def test_pallas_interpret_matches_naive(backend, case):
    T, K, V, C, gate, dtype = CASES[case]
    args = _inputs(T, K, V, dtype, gate=gate)
    seg = jnp.asarray([[0] * 16 + [1] + [2] * (T - 17)])  # a boundary on a chunk edge, a 1-token segment
    got = _value_and_grads(*args, seg, backend, C)
    want = _value_and_grads(*args, seg, "naive", C)
    # bf16: q, k, v, o and their gradients are bf16, and the kernels feed the state, U, W and delta to the
    # matrix units as bf16 (fla's convention): a few bf16 ulps of the largest entry.
    _check(got, want, 3e-2 if dtype == jnp.bfloat16 else 2e-5)


def test_pallas_gpu_split_over_v_and_key_blocks(monkeypatch):
    """Several V blocks per head in the sweeps and several key blocks in the prologue's pair products give the
    same numbers."""
    monkeypatch.setattr(kda_pallas_gpu, "BLOCK_V", 16)
    monkeypatch.setattr(kda_pallas_gpu, "BLOCK_K", 16)
    args = _inputs(24, 32, 48, jnp.float32, seed=2)  # V pads to 64: four blocks of 16; K two blocks of 16
    seg = jnp.asarray([[0] * 5 + [1] * 19])
    _check(_value_and_grads(*args, seg, "pallas_gpu", 16), _value_and_grads(*args, seg, "naive", 16), 2e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_gpu_gradient_kernels_match_chunk_math(monkeypatch, dtype):
    """The backward's two gradient kernels, over several V blocks and key blocks, against chunk_math.backward batched
    by XLA on the same prologue and states (GRAD_KERNELS off): the same math, so fp32 agrees to rounding and bf16
    (the same bf16 operands into every matmul) to float32 rounding of the sums."""
    monkeypatch.setattr(kda_pallas_gpu, "GRAD_BLOCK_V", 16)
    monkeypatch.setattr(kda_pallas_gpu, "GRAD_BLOCK_K", 16)
    args = _inputs(50, 24, 40, dtype, seed=3)  # K pads to 32: two key blocks; V to 64: four V blocks
    seg = jnp.asarray([[0] * 10 + [1] * 25 + [2] * 15])
    got = _value_and_grads(*args, seg, "pallas_gpu", 16)
    monkeypatch.setattr(kda_pallas_gpu, "GRAD_KERNELS", False)
    _value_and_grads.clear_cache()
    want = _value_and_grads(*args, seg, "pallas_gpu", 16)
    _value_and_grads.clear_cache()
    _check(got, want, 1e-5)


def test_pallas_gpu_rejects_non_power_of_two_chunk():
    x = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="power of two"):
        kda.kda(x, x, x, x, jnp.zeros((1, 8, 1)), chunk_size=24, backend="pallas_gpu", interpret=True)


@pytest.mark.parametrize("backend, platform, marker", [("pallas_gpu", "cuda", "custom_call @__gpu$xla.gpu.triton"),
                                                       ("pallas_tpu", "tpu", "custom_call @tpu_custom_call"),
                                                       ("auto", "cuda", "custom_call @__gpu$xla.gpu.triton"),
                                                       ("auto", "tpu", "custom_call @tpu_custom_call")])
@pytest.mark.parametrize("T, D, dtype", [(1088, 128, jnp.bfloat16), (100, 24, jnp.float32)])
def test_kernels_lower_for_real_hardware(backend, platform, marker, T, D, dtype):
    """Without interpret mode, forward and backward lower through Triton / Mosaic to their kernel calls;
    "auto" picks the kernel of the platform lowered for, here on a CPU host."""

    def loss(q, k, v, g, beta, seg):
        o = kda.kda(q, k, v, g, beta, segment_ids=seg, backend=backend, interpret=False).astype(jnp.float32)
        return jnp.sum(o * o)  # the gradient needs o, so the forward kernel is live

    x = jax.ShapeDtypeStruct((2, T, 4, D), dtype)
    args = (x, x, x, jax.ShapeDtypeStruct((2, T, 4, D), jnp.float32), jax.ShapeDtypeStruct((2, T, 4), jnp.float32),
            jax.ShapeDtypeStruct((2, T), jnp.int32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    text = grad.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    # forward, state sweep, reverse sweep; on Triton also the two prologue kernels in the forward and the backward
    # and the backward's two gradient kernels
    assert text.count(marker) == (9 if platform == "cuda" else 3)
