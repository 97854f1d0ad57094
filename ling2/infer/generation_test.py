"""Cached generation against independent oracles.

- greedy tokens equal argmax over full no-cache forwards of the growing sequence (the
  training forward: chunked GLA, blocked attention, no cache);
- a batch of prompts of different lengths (left-padded) gives every row what it gives alone;
- the absorbed latent-space MLA decode gives the tokens of the expanded K/V decode;
- packed prefill (several prompts per row, then one row each) gives every prompt's tokens alone;
- nothing retraces per token or per call of equal shapes; the MoE is dropless at batch 1 and 64
  (the capacity path is never called);
- GLA end states of packed documents equal the per-token recurrence run on each document.
"""

import numpy as np
import pytest
import jax.numpy as jnp

from ling2.infer.generation import Generator, InferError, generate, pack_rows
from ling2.infer.testing.models import greedy_by_full_forward, micro, prompts
from ling2.kernels import gla
from ling2.kernels.gla.reference import naive_recurrence
from ling2.layers.moe import experts as moe_experts

N = 10
LENGTHS = (5, 37, 1)  # a prompt past the 32-token bucket, a one-token prompt


@pytest.fixture(scope="module")
def setup():
    cfg, model = micro()
    g = Generator(model)
    ps = prompts(cfg.vocab_size, LENGTHS)
    return cfg, model, g, ps, g.generate(ps, N)


def test_greedy_equals_argmax_of_full_forwards(setup):
    _, model, _, ps, batch = setup
    assert all(len(r) == N for r in batch.ids)
    assert batch.ids == greedy_by_full_forward(model, ps, N)


def test_every_row_equals_the_row_generated_alone(setup):
    _, _, g, ps, batch = setup
    assert [g.generate([p], N).ids[0] for p in ps] == batch.ids


def test_absorbed_decode_equals_expanded_decode(setup):
    _, _, g, ps, batch = setup
    assert g.generate(ps, N, absorb=False).ids == batch.ids


def test_packed_prefill_equals_each_prompt_alone(setup):
    _, _, g, ps, batch = setup
    out = g.generate(ps, N, packed=True)
    assert out.ids == batch.ids


def test_pack_rows_first_fit_decreasing():
    assert pack_rows([5, 37, 1, 30], 40) == [[1, 2], [3, 0]]
    assert pack_rows([3], 3) == [[0]]


def test_one_trace_per_shape_not_per_token(setup):
    cfg, model, _, ps, batch = setup
    g = Generator(model)
    assert g.generate(ps, N).ids == batch.ids
    assert g.traces == {"prefill": 1, "decode": 1}  # N - 1 decode steps inside one traced loop
    other = prompts(cfg.vocab_size, (4, 40, 2), seed=1)  # same buckets: same shapes
    g.generate(other, N, seed=5)
    assert g.traces == {"prefill": 1, "decode": 1}


def test_moe_is_dropless_at_batch_1_and_64(setup, monkeypatch):
    cfg, model, g, ps, batch = setup

    def capacity_path(*a, **k):
        raise AssertionError("the capacity (dropping) MoE path was used")

    monkeypatch.setattr(moe_experts, "dense_capacity", capacity_path)
    rng = np.random.default_rng(2)
    many = [ps[i % 3] if i in (0, 31, 63) else rng.integers(3, cfg.vocab_size, rng.integers(1, 40))
            for i in range(64)]
    out = Generator(model).generate(many, N)
    assert [out.ids[0], out.ids[31], out.ids[63]] == [batch.ids[0], batch.ids[31 % 3], batch.ids[63 % 3]]
    assert [g.generate([p], N).ids[0] for p in many[1:3]] == out.ids[1:3]


def test_capacity_moe_is_refused():
    _, model = micro(sparse_matmul=False)
    with pytest.raises(InferError, match="sparse_matmul=False"):
        Generator(model)


def test_stop_ids_end_a_row_after_the_stop_token(setup):
    _, _, g, ps, batch = setup
    stop = batch.ids[0][3]
    out = g.generate(ps, N, stop_ids=[stop])
    for got, full in zip(out.ids, batch.ids):
        cut = full.index(stop) + 1 if stop in full else N
        assert got == full[:cut]


def test_bad_input_is_named(setup):
    cfg, model, g, ps, _ = setup
    with pytest.raises(InferError, match="prompt 1: empty"):
        g.generate([ps[0], []], 4)
    with pytest.raises(InferError, match=rf"prompt 0: token id {cfg.vocab_size} at offset 1 is outside"):
        g.generate([[5, cfg.vocab_size, 7]], 4)
    with pytest.raises(InferError, match="no prompts"):
        g.generate([], 4)
    with pytest.raises(InferError, match="max_new_tokens=0"):
        g.generate(ps, 0)
    with pytest.raises(InferError, match="top_p"):
        generate(model, ps, 4, temperature=1.0, top_p=0.0)
    for seed in (2**63, -2**63 - 1, 2**70):  # PRNGKey takes int64: past it, an OverflowError
        with pytest.raises(InferError, match=rf"^--seed={seed}: must be a 64-bit signed integer$"):
            generate(model, ps, 4, temperature=1.0, seed=seed)
    _, no_mtp = micro(mtp_num_layers=0)
    with pytest.raises(InferError, match="no MTP layers"):
        Generator(no_mtp).generate(ps, 4, speculative=True)


def test_segment_end_states_equal_the_recurrence_per_document():
    """Reference: the per-token recurrence (gla/reference.py's naive_recurrence) on each document alone."""
    rng = np.random.default_rng(0)
    B, T, H, K, V = 2, 23, 3, 8, 4
    k = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0.05, 1.0, H), jnp.float32)
    cuts = [[0, 7, 19, T], [0, 23]]  # row 0: three documents then nothing; row 1: one
    seg = np.zeros((B, T), np.int32)
    for b, c in enumerate(cuts):
        for d in range(len(c) - 1):
            seg[b, c[d]:c[d + 1]] = d + 1
    got = np.asarray(gla.segment_end_states(k, v, g, jnp.asarray(seg), 4))
    for b, c in enumerate(cuts):
        for d in range(4):
            if d < len(c) - 1:
                s, e = c[d], c[d + 1]
                q = jnp.zeros((1, e - s, H, K))
                _, want = naive_recurrence(q, k[b:b + 1, s:e], v[b:b + 1, s:e], jnp.broadcast_to(g, (1, e - s, H)),
                                           jnp.zeros((1, e - s), jnp.int32), jnp.zeros((1, H, K, V)), 1.0)
                np.testing.assert_allclose(got[b, d], np.asarray(want)[0], rtol=1e-5, atol=1e-5)
            else:
                assert not got[b, d].any()
