"""attention_kernel=cudnn on a real NVIDIA GPU: cuDNN's fused attention (bf16, causal, packed documents) against
the plain softmax attention (`dot_product_attention`, fp32 at HIGHEST) on the CPU device of the same process,
values and gradients. Needs a GPU (fails, does not skip, without one); tagged `manual` and `gpu`:
    PYTHONPATH=. python -m pytest ling2/kernels/attention/cudnn_gpu_device_test.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels.attention import cudnn, dense

if jax.default_backend() != "gpu":
    raise RuntimeError(f"cudnn_gpu_device_test needs a GPU; JAX's default backend is {jax.default_backend()!r}")


@pytest.mark.parametrize("K,V", [(96, 64), (192, 128)])  # ling2-small's head dims; ling2's (Hopper and later)
def test_cudnn_attention_on_device_matches_plain_attention(K, V):
    B, T, H = 2, 1024, 4
    r = np.random.default_rng(5)
    q, k = (r.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = r.standard_normal((B, T, H, V)).astype(np.float32)
    seg = np.stack([np.searchsorted([300, 301, 777], np.arange(T), side="right"), np.zeros(T, int)]).astype(np.int32)
    w = r.standard_normal((B, T, H, V)).astype(np.float32)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w)

    fused = lambda q, k, v: cudnn.cudnn_attention(q, k, v, jnp.asarray(seg), K**-0.5, block=128)
    idx = np.broadcast_to(np.arange(T), (B, T))
    mask = dense.attention_mask(seg, seg, idx, idx)

    def plain(q, k, v):
        with jax.default_matmul_precision("highest"):
            return dense.dot_product_attention(q, k, v, mask, K**-0.5)

    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    run = jax.jit(lambda *a: (fused(*a), jax.grad(loss(fused), argnums=(0, 1, 2))(*a)))
    text = jax.jit(lambda *a: jax.grad(loss(fused), argnums=(0, 1, 2))(*a)).lower(*bf).compile().as_text()
    assert "__cudnn$fmha" in text
    got_o, got_g = run(*bf)
    cpu = jax.devices("cpu")[0]
    ref_in = [jax.device_put(jnp.asarray(x, jnp.float32), cpu) for x in bf]
    want_o = plain(*ref_in)
    want_g = jax.grad(loss(plain), argnums=(0, 1, 2))(*ref_in)
    for name, a, b in [("o", got_o, want_o)] + list(zip(("dq", "dk", "dv"), got_g, want_g)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < 3e-2, f"{name}: max error {err:.3g} of the largest entry"
