"""The attention op's backends against the plain einsums (a naive softmax over the [T, S] logits with the
causal, same-document mask), and splash's block tables against splash's own causal mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ling2.kernels.attention import dense, splash


@pytest.mark.parametrize("block", [4, 5, 64])
def test_blocked_attention_matches_dot_product_with_grads(block):
    """Blocks of 4 and 5 over T=13 (a partial last block) and one block; packed segments."""
    r = np.random.default_rng(3)
    B, T, H = 2, 13, 2
    q, k = (jnp.asarray(r.normal(size=(B, T, H, 6)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.normal(size=(B, T, H, 3)), jnp.float32)
    seg = jnp.asarray([[1] * 6 + [2] * 1 + [3] * 6, [4] * 13], jnp.int32)
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))
    full = lambda q, k, v: dense.dot_product_attention(q, k, v, dense.attention_mask(seg, seg, idx, idx), 0.3)
    blocked = lambda q, k, v: dense.blocked_attention(q, k, v, seg, 0.3, block)
    np.testing.assert_allclose(np.asarray(blocked(q, k, v)), np.asarray(full(q, k, v)), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for gb, gf in zip(jax.grad(loss(blocked), (0, 1, 2))(q, k, v), jax.grad(loss(full), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(gb), np.asarray(gf), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_seq_shards", [1, 4])
def test_causal_block_summary_gives_splash_s_own_tables(q_seq_shards):
    """splash.causal_mask answers whole blocks with one value; splash's processed tables (forward and
    dK/dV) are the same as from its own CausalMask (reference: splash's mask processing)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

    for process in (mi.process_mask, mi.process_mask_dkv):
        want = process(sm.MultiHeadMask([sm.CausalMask((1024, 1024))] * 2), (128, 128), q_seq_shards=q_seq_shards)
        got = process(sm.MultiHeadMask([splash.causal_mask(1024)] * 2), (128, 128), q_seq_shards=q_seq_shards)
        for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(got[0])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert len(jax.tree.leaves(want[0])) == len(jax.tree.leaves(got[0])) > 0
