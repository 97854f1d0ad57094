"""The Pallas GPU grouped matmul compiled and run on a real NVIDIA GPU, against per-group products on the CPU.

Needs a GPU (fails, does not skip, without one); Bazel tags it `manual` and `gpu`. On a GPU machine:
    PYTHONPATH=. python -m pytest ling2/kernels/moe/gpu_device_test.py
What only hardware shows: Triton's lowering of the masked stores and per-group loops, tensor-core rounding,
and rows no visit writes (they would hold whatever the allocator left: a mismatch).
Reference: `jax.lax.ragged_dot` and its autodiff on the CPU device of the same process, fp32 HIGHEST, on the
same (bf16-rounded) inputs; pallas_gpu_test checks the kernels against a numpy per-group product.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels.moe import pallas_gpu

if jax.default_backend() != "gpu":
    raise RuntimeError(f"gmm gpu_device_test needs a GPU; JAX's default backend is {jax.default_backend()!r}")

CPU = jax.devices("cpu")[0]


@pytest.mark.parametrize("M,D,F,sizes,dtype,tol", [
    (4096, 512, 128, [700, 0, 1300, 1, 1999, 0, 96, 0], jnp.bfloat16, 2e-2),
    (2000, 256, 64, [0, 333, 1000, 0, 7, 600], jnp.float32, 1e-4),  # rows past the groups: zeros
])
def test_gmm_and_gradients_on_gpu(M, D, F, sizes, dtype, tol):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((M, D)), dtype)
    w = jnp.asarray(r.standard_normal((len(sizes), D, F)) * D**-0.5, dtype)
    dy = jnp.asarray(r.standard_normal((M, F)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)

    def grads(mm):
        def f(x, w, gs, dy):
            y, vjp = jax.vjp(lambda x, w: mm(x, w, gs), x, w)
            return (y, *vjp(dy))
        return f

    with jax.default_matmul_precision("highest"):
        got = jax.jit(grads(pallas_gpu.grouped_matmul))(x, w, gs, dy)
        cpu = lambda a, dt=jnp.float32: jax.device_put(jnp.asarray(a, dt), CPU)
        want = jax.jit(grads(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs)))(cpu(x), cpu(w), cpu(gs, jnp.int32),
                                                                             cpu(dy))
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        scale = np.abs(b).max()
        assert np.abs(a - b).max() <= tol * scale, (name, np.abs(a - b).max(), scale)


def test_grouped_swiglu_and_gradients_on_gpu():
    """The fused gate/up kernel, the down gmm and the SwiGLU VJP (bf16) against the same SwiGLU by ragged_dot on the
    CPU in fp32."""
    M, D, F, sizes = 4096, 256, 128, [700, 0, 1300, 1, 1999, 0, 96, 0]
    r = np.random.default_rng(1)
    bf = lambda *s: jnp.asarray(r.standard_normal(s) * s[-2] ** -0.5, jnp.bfloat16)
    x, wg, wu, wd, dy = bf(M, D), bf(8, D, F), bf(8, D, F), bf(8, F, D), bf(M, D)
    gs = jnp.asarray(sizes, jnp.int32)

    def run(f):
        def g(x, wg, wu, wd, gs, dy):
            y, vjp = jax.vjp(lambda *a: f(*a, gs), x, wg, wu, wd)
            return (y, *vjp(dy))
        return g

    def ref(x, wg, wu, wd, gs):
        mm = lambda a, w: jax.lax.ragged_dot(a, w, gs)
        return mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)

    got = jax.jit(run(lambda x, wg, wu, wd, gs: pallas_gpu.grouped_swiglu(x, gs, wg, wu, wd)))(x, wg, wu, wd, gs, dy)
    cpu = lambda a, dt=jnp.float32: jax.device_put(jnp.asarray(a, dt), CPU)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(run(ref))(*(cpu(a) for a in (x, wg, wu, wd)), cpu(gs, jnp.int32), cpu(dy))
    for name, a, b in zip(("y", "dx", "dwg", "dwu", "dwd"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.abs(a - b).max() <= 3e-2 * np.abs(b).max(), (name, np.abs(a - b).max(), np.abs(b).max())


def test_fp8_swiglu_and_gradients_on_gpu():
    """The float8 SwiGLU (per-tensor scaling: e4m3 rows, h and weights, e5m2 gradients) compiled for the GPU, against
    the same function interpreted on the CPU device: the quantization is elementwise and repeats exactly, so both
    multiply the same float8 values and differ only in the order of their fp32 sums (pallas_gpu_fp8_test checks the
    interpreted function against a numpy reference of the recipe)."""
    M, D, F, sizes = 4096, 256, 128, [700, 0, 1300, 1, 1999, 0, 96, 0]
    r = np.random.default_rng(2)
    x, dy = (jnp.asarray(r.standard_normal((M, D)), jnp.bfloat16) for _ in range(2))
    wg, wu = (jnp.asarray(r.standard_normal((8, D, F)) * D**-0.5, jnp.float32) for _ in range(2))
    wd = jnp.asarray(r.standard_normal((8, F, D)) * F**-0.5, jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)

    def run(interpret):
        def g(x, wg, wu, wd, gs, dy):
            f = lambda *a: pallas_gpu.grouped_swiglu_fp8(a[0], gs, *a[1:], interpret=interpret)  # noqa: E731
            y, vjp = jax.vjp(f, x, wg, wu, wd)
            return (y, *vjp(dy))
        return g

    got = jax.jit(run(False))(x, wg, wu, wd, gs, dy)
    want = jax.jit(run(True))(*(jax.device_put(a, CPU) for a in (x, wg, wu, wd, gs, dy)))
    for name, a, b in zip(("y", "dx", "dwg", "dwu", "dwd"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max(), (name, np.abs(a - b).max(), np.abs(b).max())
