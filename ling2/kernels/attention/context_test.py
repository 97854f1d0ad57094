"""The balanced (zigzag) context-parallel attention on 8 fake CPU devices against plain softmax attention over the
whole sequence (`dot_product_attention`: the naive formula), values and gradients, with packed documents that
span shard edges; and the causal work per device it does against the contiguous layout's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ling2.kernels.attention.context import balanced_context_attention, key_blocks_per_device, zigzag_chunks
from ling2.kernels.attention.dense import attention_mask, dot_product_attention

B, H, K, V = 2, 3, 8, 5


def case(T, seed=0):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.normal(size=(B, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.normal(size=(B, T, H, V)), jnp.float32)
    cuts = np.sort(r.choice(np.arange(1, T), size=5, replace=False))  # documents across shard edges
    seg = jnp.asarray(np.stack([np.searchsorted(cuts, np.arange(T), side="right") + 1, np.ones(T, np.int64)]),
                      jnp.int32)
    return q, k, v, seg


def reference(q, k, v, seg, scale):
    T = q.shape[1]
    index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), seg.shape)
    return dot_product_attention(q, k, v, attention_mask(seg, seg, index, index), scale)


def balanced(n, block):
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("context",), axis_types=(AxisType.Auto,))

    def f(q, k, v, seg):
        def body(q, k, v, seg, kv_seg):
            return balanced_context_attention(q, k, v, seg, kv_seg, 0.3, axis_name="context", block=block)
        split = P(None, "context")
        return jax.shard_map(body, mesh=mesh, in_specs=(split, P(), P(), split, P()), out_specs=split)(
            q, k, v, seg, seg)

    return mesh, f


@pytest.mark.parametrize("n, T, block", [(2, 32, 4), (4, 64, 8), (8, 64, 2), (8, 128, 64)])
def test_equals_attention_over_the_whole_sequence(n, T, block):
    assert jax.device_count() >= n
    q, k, v, seg = case(T, seed=n)
    ct = jnp.asarray(np.random.default_rng(9).normal(size=(B, T, H, V)), jnp.float32)
    mesh, f = balanced(n, block)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v, seg) * ct)

    want = reference(q, k, v, seg, 0.3)
    want_grads = jax.grad(loss(lambda *a: reference(*a, 0.3)), argnums=(0, 1, 2))(q, k, v)
    with jax.set_mesh(mesh):
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))  # noqa: E731
        args = [put(x) for x in (q, k, v)]
        got = jax.jit(f)(*args, put(seg))
        got_grads = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [4, 8, 16, 32, 64, 128])
def test_every_device_does_the_same_causal_work(n):
    """Key chunks (of 2n) each device's queries see: 2n+1 on every device in the zigzag layout (max / mean = 1),
    against (4n-1) / (2n+1) of the mean for the contiguous layout's last shard (chunks 2n-2 and 2n-1)."""
    work = key_blocks_per_device(n)
    assert set(work) == {2 * n + 1} and max(work) / (sum(work) / n) <= 1.1
    assert sorted(c for pair in zigzag_chunks(n) for c in pair) == list(range(2 * n))
    contiguous = [(2 * i + 1) + (2 * i + 2) for i in range(n)]
    assert max(contiguous) / (sum(contiguous) / n) == pytest.approx((4 * n - 1) / (2 * n + 1)) and n < 4 or \
        max(contiguous) / (sum(contiguous) / n) > 1.6
