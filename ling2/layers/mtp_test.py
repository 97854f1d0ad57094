"""MTP tests: document-aware shifting, per-depth loss sums against a hand calculation in numpy,
the wiring of depth 1 against a hand composition, gradients to the shared embedding and
lm_head, no-MTP == plain decoder bit for bit, and packing isolation with MTP on.

Model: ling2-micro (GLA dense, MLA MoE), vocab 1024, two MTP depths.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers.decoder import Ling2Decoder
from ling2.layers.model import Ling2Model
from ling2.layers.mtp import (MTP, top1_accuracy, depth_token_counts, mtp_loss,
                              roll_and_mask_by_segment)
from ling2.layers.spec import ModelSpec

F = -1  # fill value in the hand-written cases


def _cfg(**kw):
    base = dict(model_name="ling2-micro", vocab_size=1024, mtp_num_layers=2)
    return load_config(**{**base, **kw})


# --- roll_and_mask_by_segment --------------------------------------------------------------

SEG = np.array([[1, 1, 1, 2, 3, 3, 3, 3, 0, 0],  # docs of 3, 1 (length one), 4, then 2 padding
                [5, 5, 7, 7, 5, 5, 5, 5, 5, 5]])  # id 5 comes back: a new document
X = np.array([[10, 11, 12, 20, 30, 31, 32, 33, 90, 91],
              [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]])


@pytest.mark.parametrize("k, rolled, valid", [
    (0, X, np.ones_like(X)),
    (1, [[11, 12, F, F, 31, 32, 33, F, 91, F],
         [101, F, 103, F, 105, 106, 107, 108, 109, F]],
        [[1, 1, 0, 0, 1, 1, 1, 0, 1, 0],
         [1, 0, 1, 0, 1, 1, 1, 1, 1, 0]]),
    (2, [[12, F, F, F, 32, 33, F, F, F, F],
         [F, F, F, F, 106, 107, 108, 109, F, F]],
        [[1, 0, 0, 0, 1, 1, 0, 0, 0, 0],
         [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]]),
    (4, [[F] * 10, [F, F, F, F, 108, 109, F, F, F, F]],  # longer than every doc of row 0
        [[0] * 10, [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]]),
    (12, [[F] * 10] * 2, [[0] * 10] * 2),  # past the row end
])
def test_roll_and_mask_by_segment_hand_written(k, rolled, valid):
    r, v = roll_and_mask_by_segment(jnp.asarray(X), jnp.asarray(SEG), k, fill=F)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(rolled))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(valid, bool))


def _naive_roll(x, seg, k, fill):
    """Loop reference: t+k must be in the row and every position t..t+k in t's segment."""
    B, T = x.shape
    out, ok = np.full_like(x, fill), np.zeros(x.shape, bool)
    for b in range(B):
        for t in range(T):
            if t + k < T and all(seg[b, j] == seg[b, t] for j in range(t, t + k + 1)):
                out[b, t], ok[b, t] = x[b, t + k], True
    return out, ok


def test_roll_and_mask_by_segment_random_rows_match_loop():
    rng = np.random.default_rng(0)
    roll = jax.jit(roll_and_mask_by_segment, static_argnums=2)
    for k in range(7):
        seg = np.cumsum(rng.random((16, 9)) < 0.3, axis=1) % 3  # ids reused after other ids
        x = rng.integers(0, 1000, (16, 9))
        r, v = roll(jnp.asarray(x), jnp.asarray(seg), k, -7)
        want_r, want_v = _naive_roll(x, seg, k, -7)
        np.testing.assert_array_equal(np.asarray(r), want_r)
        np.testing.assert_array_equal(np.asarray(v), want_v)


def test_roll_and_mask_by_segment_rejects_bad_shapes():
    with pytest.raises(ValueError, match="segment_ids"):
        roll_and_mask_by_segment(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 4), jnp.int32), 1)
    with pytest.raises(ValueError, match="k must be"):
        roll_and_mask_by_segment(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 5), jnp.int32), -1)


# --- loss helpers -----------------------------------------------------------------------------

def test_mtp_loss_and_top1_accuracy_hand_values():
    # depth 1: 6/3 = 2, depth 2: 3/1 = 3 -> 0.1 * (2 + 3) / 2
    np.testing.assert_allclose(mtp_loss(jnp.array([6.0, 3.0]), jnp.array([3.0, 1.0]), 0.1), 0.25, rtol=1e-6)
    # a depth with no valid token adds 0 (not nan)
    np.testing.assert_allclose(mtp_loss(jnp.array([6.0, 0.0]), jnp.array([3.0, 0.0]), 0.1), 0.1, rtol=1e-6)
    np.testing.assert_allclose(top1_accuracy(jnp.array([2.0, 0.0]), jnp.array([4.0, 0.0])), [0.5, 0.0])


# --- the model -------------------------------------------------------------------------------

B, T, LA = 3, 12, 5  # rows: [A | B], [A | C], [D | B]; A, D have 5 tokens, B, C have 7


def _batch(V):
    rng = np.random.default_rng(1)
    doc = lambda n: rng.integers(1, V, n)
    A, Bd, C, D = doc(LA), doc(T - LA), doc(T - LA), doc(LA)
    ids = np.stack([np.r_[A, Bd], np.r_[A, C], np.r_[D, Bd]]).astype(np.int32)
    seg = np.tile(np.r_[[1] * LA, [2] * (T - LA)], (B, 1)).astype(np.int32)
    pos = np.tile(np.r_[np.arange(LA), np.arange(T - LA)], (B, 1)).astype(np.int32)
    targets = np.concatenate([ids[:, 1:], np.zeros((B, 1), np.int32)], axis=1)
    w = np.ones((B, T), np.float32)
    w[:, [LA - 1, T - 1]] = 0  # a document's last token has no next token
    w[1, 2] = w[2, 8] = 0  # a few more masked positions, so rows differ
    return ids, targets, w, pos, seg


@nnx.jit(static_argnames="return_logits")
def _forward(model, ids, targets, w, pos, seg, return_logits=True):
    out = model(ids, pos, seg)
    d = model.decoder
    return out, model.mtp(d, out, ids, targets, w, pos, seg, return_logits=return_logits)


@pytest.fixture(scope="module")
def setup():
    cfg = _cfg()
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    batch = _batch(cfg.vocab_size)
    out, mtp = _forward(model, *map(jnp.asarray, batch))
    return cfg, model, batch, out, mtp


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_per_depth_sums_and_loss_match_hand_calculation(setup):
    cfg, _, (ids, targets, w, pos, seg), _, mtp = setup
    assert len(mtp.logits) == cfg.mtp_num_layers == 2
    sums, counts, correct = [], [], []
    for k in (1, 2):
        logp = _log_softmax(np.asarray(mtp.logits[k - 1], np.float64))
        s = n = c = 0.0
        for b in range(B):
            for t in range(T):
                j = t + k
                if j < T and len(set(seg[b, t:j + 1])) == 1 and w[b, j] > 0:
                    s += -logp[b, t, targets[b, j]]
                    n += w[b, j]
                    c += float(np.argmax(logp[b, t]) == targets[b, j])
        sums.append(s), counts.append(n), correct.append(c)
    # by hand: depth 1 [A|B] 3+5, [A|C] 2+5, [D|B] 3+4; depth 2: 2+4, 1+4, 2+3
    assert counts == [22.0, 16.0]
    np.testing.assert_allclose(np.asarray(mtp.ce_count), counts)
    np.testing.assert_allclose(np.asarray(depth_token_counts(jnp.asarray(w), jnp.asarray(seg), 2)), counts)
    np.testing.assert_allclose(np.asarray(mtp.ce_sum), sums, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mtp.correct), correct)
    want = cfg.mtp_loss_scaling_factor * (sums[0] / counts[0] + sums[1] / counts[1]) / 2
    np.testing.assert_allclose(mtp_loss(mtp.ce_sum, mtp.ce_count, cfg.mtp_loss_scaling_factor), want, rtol=1e-5)
    assert sorted(mtp.moe_aux) == [2, 3]  # global layer indices L + k - 1


def test_depth_one_matches_hand_composition(setup):
    """Depth 1 = lm_head(final_norm(layer(eh_proj [enorm(embed(ids[t+1])); hnorm(hidden[t])]))))."""
    _, model, (ids, targets, w, pos, seg), out, mtp = setup
    shifted = np.zeros_like(ids)
    shifted[:, :-1] = ids[:, 1:]
    shifted[:, [LA - 1, T - 1]] = 0  # crossing into the next document / past the end: fill

    @nnx.jit
    def hand(model, shifted, hidden):
        d, dec = model.mtp.depths[0], model.decoder
        x = jnp.concatenate([d.enorm(dec.embed(shifted)), d.hnorm(hidden)], axis=-1) @ d.eh_proj[...]
        y, _ = d.layer(x, jnp.asarray(pos), jnp.asarray(seg), layer_index=d.index)
        return dec.lm_head(d.final_norm(y))

    want = hand(model, jnp.asarray(shifted), out.hidden)
    np.testing.assert_allclose(np.asarray(mtp.logits[0]), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_packing_isolation_with_mtp(setup):
    """Row 0 = [A | B]; A's outputs equal row 1's ([A | C]), B's equal row 2's ([D | B])."""
    _, _, _, out, mtp = setup
    for logits in (out.logits, *mtp.logits):
        z = np.asarray(logits)
        np.testing.assert_allclose(z[0, :LA], z[1, :LA], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z[0, LA:], z[2, LA:], rtol=1e-5, atol=1e-5)
        assert np.abs(z[0, LA:] - z[1, LA:]).max() > 1e-3  # and different docs do differ


def test_gradients_reach_shared_embedding_and_lm_head(setup):
    cfg, model, (ids, targets, w, pos, seg), out, _ = setup
    hidden = jax.random.normal(jax.random.key(2), out.hidden.shape, out.hidden.dtype)

    @nnx.jit
    def grads(model):
        def loss(model):
            d = model.decoder
            o = model.mtp(d, hidden, *map(jnp.asarray, (ids, targets, w, pos, seg)))
            return mtp_loss(o.ce_sum, o.ce_count, cfg.mtp_loss_scaling_factor)
        return nnx.grad(loss)(model)

    g = grads(model)
    g_emb = np.abs(np.asarray(g.decoder.embed.embedding[...])).max(-1)
    inner = np.r_[1:LA, LA + 1:T]  # positions that are not a document's first token
    starts_only = set(ids[:, [0, LA]].ravel().tolist()) - set(ids[:, inner].ravel().tolist())
    used = {int(ids[b, t + 1]) for b in range(B) for t in range(T - 1) if seg[b, t] == seg[b, t + 1] and w[b, t + 1]}
    assert starts_only and used
    assert all(g_emb[t] > 0 for t in used)
    # a document's first token is never an MTP input (it would come from the previous document)
    assert all(g_emb[t] == 0 for t in starts_only)
    assert g_emb[sorted(set(range(cfg.vocab_size)) - set(ids.ravel().tolist()) - {0})].max() == 0
    assert np.abs(np.asarray(g.decoder.lm_head.kernel[...])).max() > 0
    assert np.abs(np.asarray(g.mtp.depths[0].eh_proj[...])).max() > 0
    assert np.abs(np.asarray(g.mtp.depths[1].layer.attention.dense[...])).max() > 0
    # the hidden state is given, so no gradient reaches the decoder's layers through MTP
    assert np.abs(np.asarray(g.decoder.layers[1].attention.dense[...])).max() == 0


def test_pre_norm_option_feeds_hidden_before_final_norm(setup):
    _, model, batch, out, _ = setup
    args = tuple(map(jnp.asarray, batch))
    run = nnx.jit(lambda model, o: model.mtp(model.decoder, o, *args).ce_sum)
    no_hidden = out._replace(hidden=jnp.zeros_like(out.hidden))
    no_pre = out._replace(hidden_pre_norm=jnp.zeros_like(out.hidden))
    assert np.abs(np.asarray(run(model, out) - run(model, no_hidden))).max() > 1e-3  # default: `hidden`
    np.testing.assert_array_equal(np.asarray(run(model, out)), np.asarray(run(model, no_pre)))
    model.mtp.pre_norm = True
    try:
        np.testing.assert_array_equal(np.asarray(run(model, out)), np.asarray(run(model, no_hidden)))
        assert np.abs(np.asarray(run(model, out) - run(model, no_pre))).max() > 1e-3
    finally:
        model.mtp.pre_norm = False


def test_tied_head_uses_the_embedding(setup):
    """A tied decoder (logits_via_embedding: no lm_head) equals an untied one whose kernel is embedding^T."""
    _, model, batch, out, _ = setup
    args = tuple(map(jnp.asarray, batch))
    run = nnx.jit(lambda model, decoder: model.mtp(decoder, out, *args).ce_sum)
    tied = nnx.clone(model.decoder)
    tied.tied, tied.lm_head = True, None
    untied = nnx.clone(model.decoder)
    untied.lm_head.kernel[...] = model.decoder.embed.embedding[...].T
    np.testing.assert_allclose(np.asarray(run(model, tied)), np.asarray(run(model, untied)), rtol=1e-5)
    assert np.abs(np.asarray(run(model, tied) - run(model, model.decoder))).max() > 1e-3


def test_no_mtp_is_the_plain_decoder_bit_for_bit():
    cfg = _cfg(mtp_num_layers=0)
    with pytest.raises(ValueError, match="mtp_num_layers"):
        MTP(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    wrapped, plain = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0)), Ling2Decoder(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    assert wrapped.mtp is None
    ws, ps = nnx.to_flat_state(nnx.state(wrapped, nnx.Param)), nnx.to_flat_state(nnx.state(plain, nnx.Param))
    assert [p[1:] for p, _ in ws] == [p for p, _ in ps]  # only the decoder's params, same names
    for (_, a), (_, b) in zip(ws, ps):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    ids, targets, w, pos, seg = map(jnp.asarray, _batch(cfg.vocab_size))
    got, none = nnx.jit(lambda m: (m(ids, pos, seg), m.loss_sums(ids, targets, w, pos, seg).mtp))(wrapped)
    want = nnx.jit(lambda m: m(ids, pos, seg))(plain)
    assert none is None
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mtp_leaves_the_decoder_weights_unchanged(setup):
    """Building MTP after the decoder keeps the decoder's weights those of the plain decoder."""
    cfg, model, *_ = setup
    plain = Ling2Decoder(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    for (pa, a), (pb, b) in zip(nnx.to_flat_state(nnx.state(model.decoder, nnx.Param)),
                                nnx.to_flat_state(nnx.state(plain, nnx.Param))):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
