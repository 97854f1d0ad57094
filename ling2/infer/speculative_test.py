"""MTP self-speculative decoding.

- greedy output is identical with and without speculation (the real MTP drafts; then drafts
  forced right or wrong in a known pattern, so full, partial and no acceptance all happen, with
  the acceptance counts predicted);
- the cached MTP drafts equal the teacher-forced MTP forward (`ling2.layers.mtp.MTP`, no cache)
  at the last prompt position, for K = 2 depths;
- with top_k = 1 sampling is greedy, with and without speculation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.infer import generation
from ling2.infer.generation import Generator, Sampling
from ling2.infer.testing.models import micro, oracle_drafts, prompts
from ling2.layers.attention.decode import DecodeOptions

N = 9
LENGTHS = (6, 2, 33)


@pytest.fixture(scope="module")
def k1():
    cfg, model = micro()
    g = Generator(model)
    ps = prompts(cfg.vocab_size, LENGTHS)
    return model, g, ps, g.generate(ps, N)


@pytest.fixture(scope="module")
def k2():
    cfg, model = micro(mtp_num_layers=2)
    g = Generator(model)
    ps = prompts(cfg.vocab_size, LENGTHS, seed=3)
    return model, g, ps, g.generate(ps, N)


def test_greedy_speculative_equals_plain(k1):
    _, g, ps, plain = k1
    out = g.generate(ps, N, speculative=True)
    assert out.ids == plain.ids
    st = out.stats
    assert len(st["acceptance_per_depth"]) == 1 and 0 <= st["acceptance_per_depth"][0] <= 1
    assert st["new_tokens"] == N * len(ps)
    assert st["drafts_examined"][0] >= N - 1  # every live row examines one depth-1 draft per round


@pytest.mark.parametrize("fixture", ["k1", "k2"])
def test_verify_and_rollback_with_known_drafts(fixture, request, monkeypatch):
    model, g, ps, plain = request.getfixturevalue(fixture)
    K = len(model.mtp.depths)
    # all drafts right: K + 1 tokens per main forward
    monkeypatch.setattr(generation, "_draft", oracle_drafts(plain.ids, N, lambda b, c, j: j < 0))
    out = Generator(model).generate(ps, N, speculative=True)
    assert out.ids == plain.ids
    assert out.stats["acceptance_per_depth"] == [1.0] * K
    assert out.stats["main_forwards"] == 1 + -(-(N - 1) // (K + 1))
    # wrong drafts in a pattern: rows and depths accept different counts
    wrong = lambda b, c, j: (b + c + j) % 3 == 0  # noqa: E731
    monkeypatch.setattr(generation, "_draft", oracle_drafts(plain.ids, N, wrong))
    out = Generator(model).generate(ps, N, speculative=True)
    assert out.ids == plain.ids
    acc = out.stats["acceptance_per_depth"]
    assert 0 < acc[0] < 1
    # none right: one token per forward, as plain decoding
    monkeypatch.setattr(generation, "_draft", oracle_drafts(plain.ids, N, lambda b, c, j: j > 0))
    out = Generator(model).generate(ps, N, speculative=True)
    assert out.ids == plain.ids
    assert out.stats["drafts_accepted"] == [0] * K and out.stats["main_forwards"] == N


def test_cached_drafts_equal_teacher_forced_mtp_forward(k2):
    """Depth 1 drafts from the main hidden state and the first generated token; depth 2 from depth 1's
    state and depth 1's draft. MTP.__call__ on prompt + [first, draft 1] gives the same argmaxes."""
    model, _, ps, _ = k2
    lay = generation.make_layout(ps, N, 2)
    ids, pos, seg = generation.padded_inputs(ps, lay)
    s = Sampling()

    @nnx.jit
    def drafts(model, ids, pos, seg):
        pre = generation._prefill_padded(model, ids, pos, seg, lay.S)
        lengths = jnp.asarray([len(p) for p in ps], jnp.int32)
        loop = generation._start(pre, lay, lengths, N, 2, jax.random.PRNGKey(0), s, ())
        loop = generation._spec_start(model, loop, pre, ids, pos, seg, lay, 2)
        d, _, _ = generation._draft(model, loop, 4, s, jax.random.PRNGKey(1), DecodeOptions())
        return loop.last, d

    first, d = (np.asarray(x) for x in drafts(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
    for b, p in enumerate(ps):
        seq = np.concatenate([p, [first[b], d[b, 0], d[b, 1]]]).astype(np.int32)[None]
        x, tgt = seq[:, :-1], seq[:, 1:]
        T = x.shape[1]
        posb = np.arange(T, dtype=np.int32)[None]
        one = np.ones((1, T), np.int32)

        @nnx.jit
        def mtp_logits(model, x, tgt, posb, one):
            out = model(x, posb, one)
            res = model.mtp(model.decoder, out, x, tgt, one.astype(jnp.float32), posb, one, return_logits=True)
            return res.logits

        logits = [np.asarray(a) for a in mtp_logits(model, x, tgt, posb, one)]
        L = len(p)  # position L - 1: the last prompt token; depth k there predicts token L + k
        assert int(np.argmax(logits[0][0, L - 1])) == d[b, 0]
        assert int(np.argmax(logits[1][0, L - 1])) == d[b, 1]


def test_top_k_1_sampling_is_greedy_with_and_without_speculation(k1):
    _, g, ps, plain = k1
    s = Sampling(temperature=0.7, top_k=1)
    assert g.generate(ps, N, sampling=s, seed=3).ids == plain.ids
    assert g.generate(ps, N, sampling=s, seed=4, speculative=True).ids == plain.ids
