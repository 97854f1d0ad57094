"""The Pallas GPU (Triton) kernels compiled and run on a real NVIDIA GPU, against the naive recurrence.

Needs a GPU (fails, does not skip, without one); Bazel tags it `manual` and `gpu`, so
`bazel test //...` leaves it out. Run on a GPU machine:
    PYTHONPATH=. python -m pytest ling2/kernels/gpu_device_test.py
The interpret-mode tests (gla/pallas_test.py, kda/pallas_test.py) check the same kernel code on CPU;
this one checks what only hardware shows: Triton's lowering, real tensor-core rounding, races
between programs, rows a kernel never writes (whatever the allocator left there: a mismatch).

Reference: gla/reference.py and kda/reference.py's naive_recurrence (plain per-token scans,
autodiff gradients, HIGHEST precision) run on the CPU device of the same process, in fp32, on
the same inputs; gla_test and kda_test check those oracles against flash-linear-attention's naive ops.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels import gla, kda

if jax.default_backend() != "gpu":
    raise RuntimeError(f"gpu_device_test needs a GPU; JAX's default backend is {jax.default_backend()!r}")

CPU = jax.devices("cpu")[0]
GPU = jax.devices()[0]


def _loss_grads(fn, n_args):
    @functools.partial(jax.jit, static_argnames=("backend", "C"))
    def run(*args, backend, C):
        *xs, seg = args

        def loss(*xs):
            o, hT = fn(*xs, seg, backend=backend, C=C)
            o32 = o.astype(jnp.float32)
            return jnp.sum(o32 * jnp.cos(o32)) + 0.3 * jnp.sum(hT * jnp.sin(hT)), (o, hT)

        (_, aux), grads = jax.value_and_grad(loss, argnums=tuple(range(n_args)), has_aux=True)(*xs)
        return aux + grads

    return run


def _gla(q, k, v, g, h0, seg, *, backend, C):
    return gla.simple_gla(q, k, v, g, segment_ids=seg, initial_state=h0, chunk_size=C, backend=backend,
                          return_final_state=True)


def _kda(q, k, v, g, beta, h0, seg, *, backend, C):
    return kda.kda(q, k, v, g, beta, segment_ids=seg, initial_state=h0, chunk_size=C, backend=backend,
                   return_final_state=True)


GLA_RUN, KDA_RUN = _loss_grads(_gla, 5), _loss_grads(_kda, 6)
GLA_NAMES = ("o", "hT", "dq", "dk", "dv", "dg", "dh0")
KDA_NAMES = ("o", "hT", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _on(device, xs):
    return [jax.device_put(x, device) for x in xs]


def _segments(B, T, seed):
    """Packed rows: a boundary on a chunk edge (16), a one-token document, then random cuts."""
    r = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        cuts = sorted({16, 17, *r.integers(18, T, size=max(1, T // 300)).tolist()} - {T})
        rows.append(np.searchsorted(np.asarray(cuts), np.arange(T), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def _compare(names, got, want, rtol, dg_floor):
    """Each output within rtol of the reference's largest entry (dg: of max(|dg|, |dk|), since the gate
    gradient is a difference of q.dq and k.dk terms)."""
    scale = {n: float(np.abs(np.asarray(b, np.float64)).max()) for n, b in zip(names, want)}
    scale["dg"] = max(scale["dg"], scale["dk"] * dg_floor)
    for n, a, b in zip(names, got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, n
        assert np.all(np.isfinite(a)), f"{n}: non-finite entries"
        err = np.abs(a - b).max() / scale[n]
        assert err <= rtol, f"{n}: max error {err:.3g} of the largest entry > {rtol}"


GLA_CASES = {
    # name: (B, T, H, K, V, chunk, per-token g, dtype)
    "fp32_ragged_odd_dims": (1, 45, 2, 24, 40, 16, True, jnp.float32),
    "fp32_model_shape": (2, 1100, 4, 128, 128, 64, False, jnp.float32),
    "bf16_model_shape": (2, 1100, 4, 128, 128, 64, False, jnp.bfloat16),
    "bf16_per_token_g": (1, 700, 3, 64, 128, 64, True, jnp.bfloat16),
}


@pytest.mark.parametrize("case", GLA_CASES)
def test_gla_pallas_gpu_on_device_matches_naive(case):
    B, T, H, K, V, C, per_token, dtype = GLA_CASES[case]
    r = np.random.default_rng(7)
    q, k = (jnp.asarray(r.standard_normal((B, T, H, K)) * 0.5, dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
    g = -jnp.asarray(r.uniform(0, 1, (B, T, H)) if per_token else 2.0 ** (-np.arange(H) - 1.0), jnp.float32)
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    seg = _segments(B, T, 7)
    xs = (q, k, v, g, h0, seg)
    got = jax.device_get(GLA_RUN(*_on(GPU, xs), backend="pallas_gpu", C=C))
    want = jax.device_get(GLA_RUN(*_on(CPU, xs), backend="naive", C=C))
    # bf16: the state and the decayed scores enter the tensor cores as bf16 (fla's convention).
    _compare(GLA_NAMES, got, want, 5e-2 if dtype == jnp.bfloat16 else 2e-4, dg_floor=1e-3)


KDA_CASES = {
    # name: (B, T, H, K, V, chunk, gate range, dtype)
    "fp32_ragged_odd_dims": (1, 45, 2, 24, 40, 16, (-5.0, 0.0), jnp.float32),
    "fp32_model_shape": (2, 300, 4, 128, 128, 64, (-5.0, 0.0), jnp.float32),
    "bf16_model_shape": (2, 300, 4, 128, 128, 64, (-5.0, 0.0), jnp.bfloat16),
    "bf16_gate_near_-5": (1, 300, 2, 64, 64, 64, (-5.0, -4.5), jnp.bfloat16),
}


@pytest.mark.parametrize("case", KDA_CASES)
def test_kda_pallas_gpu_on_device_matches_naive(case):
    B, T, H, K, V, C, (lo, hi), dtype = KDA_CASES[case]
    r = np.random.default_rng(11)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    sig = lambda x: 1 / (1 + np.exp(-x))
    q, k = (jnp.asarray(l2(r.standard_normal((B, T, H, K))), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, T, H, V)), dtype)
    g = jnp.asarray(lo + (hi - lo) * sig(2 * r.standard_normal((B, T, H, K))), jnp.float32)
    beta = jnp.asarray(sig(r.standard_normal((B, T, H))), jnp.float32)
    h0 = jnp.asarray(r.standard_normal((B, H, K, V)), jnp.float32)
    seg = _segments(B, T, 11)
    xs = (q, k, v, g, beta, h0, seg)
    got = jax.device_get(KDA_RUN(*_on(GPU, xs), backend="pallas_gpu", C=C))
    want = jax.device_get(KDA_RUN(*_on(CPU, xs), backend="naive", C=C))
    # fp32: the kernels take TF32 for the decay products and the (I + A)^-1 solve (kda/pallas_gpu.py's _dots).
    _compare(KDA_NAMES, got, want, 5e-2 if dtype == jnp.bfloat16 else 2e-3, dg_floor=1.0)


def _custom_calls(text):
    return sorted(re.findall(r'custom_call_target="([^"]+)"', text))


def test_auto_picks_the_triton_kernels_on_the_gpu():
    """"auto" on a CUDA device compiles to the Pallas GPU kernels: the same custom calls as backend="pallas_gpu"
    (whatever this JAX names Triton calls: XLA's Triton custom call in JAX 0.10, its own in 0.11), calls the
    pure-JAX chunked form does not make, and bit-identical gradients."""
    x = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    q = jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), jnp.bfloat16)

    def compiled(backend):
        loss = lambda q: jnp.sum(gla.simple_gla(q, x, x, -jnp.ones((2,)), backend=backend).astype(jnp.float32))
        return jax.jit(jax.grad(loss)).lower(q).compile()

    auto, pallas, chunked = (compiled(b) for b in ("auto", "pallas_gpu", "chunked"))
    assert _custom_calls(auto.as_text()) == _custom_calls(pallas.as_text())
    assert set(_custom_calls(pallas.as_text())) - set(_custom_calls(chunked.as_text()))
    np.testing.assert_array_equal(np.asarray(auto(q)), np.asarray(pallas(q)))
