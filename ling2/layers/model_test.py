"""Ling2Model: the forward without targets, loss sums against their parts, expert-bias rows from the plan;
parameter counts against built models and a hand count of ling2.yml; FLOPs against a hand formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers import decoder, losses
from ling2.layers import model as model_lib
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec


def n_params(module) -> int:
    return sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("kw", [dict(), dict(q_lora_rank=0, scan_layers=True, base_num_decoder_layers=12)])
def test_counts_equal_built_model(kw):
    cfg = load_config(model_name="ling2-tiny", **kw)
    build = lambda: Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    model = nnx.eval_shape(build)  # shapes only, nothing computed
    c = model_lib.count_params(ModelSpec.of(cfg))
    assert c["decoder"] == n_params(model.decoder)
    assert c["mtp"] == n_params(model.mtp) > 0
    assert c["total"] == n_params(model)
    assert c["embed"] == c["lm_head"] == cfg.vocab_size * cfg.base_emb_dim


def test_ling2_hand_count():
    cfg = load_config(model_name="ling2")
    E, V = 2048, 157184
    gla = 2048 * 3 * 16 * 128 + 2048 * 16 * 128 + 16 * 128 * 2048 + 2 * 128 + 16 * 128  # qkv, g_proj, dense, norms
    mla = (2048 * 256 + 256 + 256 * 16 * 192  # q_a, q_a_norm, q_b
           + 2048 * (512 + 64) + 512 + 512 * 16 * (128 + 128)  # kv_a, kv_a_norm, kv_b
           + 16 * 128 * 2048)  # dense
    dense_mlp = 3 * 2048 * 5120
    moe = 2048 * 256 + 256 * 3 * 2048 * 512 + 3 * 2048 * 2048  # router, 256 experts, shared expert
    moe_active = 2048 * 256 + 8 * 3 * 2048 * 512 + 3 * 2048 * 2048
    norms = 2 * 2048
    # Layers 4, 9, 14, 19 are MLA, the other 16 GLA; layer 0 dense, 19 MoE.
    layers = 16 * gla + 4 * mla + dense_mlp + 19 * moe + 20 * norms
    mtp_layer = 3 * 2048 + 2 * 2048 * 2048 + mla + moe + norms
    total = V * E + E * V + E + layers + mtp_layer
    c = model_lib.count_params(ModelSpec.of(cfg))
    assert c["layers"] == layers
    assert c["total"] == total
    active = V * E + E * V + E + 16 * gla + 4 * mla + dense_mlp + 19 * moe_active + 20 * norms \
        + 3 * 2048 + 2 * 2048 * 2048 + mla + moe_active + norms
    assert c["active"] == active
    assert round(total / 1e9, 2) == 17.43 and round(active / 1e9, 2) == 1.83  # 16.60B without the MTP layer


def test_training_flops_per_token_by_hand():
    cfg = load_config(model_name="ling2-tiny", mtp_num_layers=0, base_num_decoder_layers=5, first_num_dense_layers=5)
    E, H, D, V, S, C = 128, 4, 32, 8192, 256, 64
    gla_mm = 5 * E * H * D
    mla_mm = E * 64 + 64 * H * 48 + E * (64 + 16) + 64 * H * (32 + 32) + H * 32 * E
    mlp = 3 * E * 384
    fwd = 2 * (4 * gla_mm + mla_mm + 5 * mlp + E * V) + 4 * H * (4 * D * D + 2 * D * C) + 2 * H * (48 + 32) * S / 2
    assert model_lib.training_flops_per_token(ModelSpec.of(cfg), S) == pytest.approx(3 * fwd)
    spec = ModelSpec.of(cfg)
    assert model_lib.training_flops_per_token(spec, 2 * S) > model_lib.training_flops_per_token(spec, S)


def test_flops_match_xla_cost_analysis_of_a_dense_forward():
    """Independent check of the matmul part: XLA's own FLOP count of a forward pass (GLA kernel excluded
    by using only MLA layers), within 10% (XLA also counts softmax/norm/elementwise work)."""
    cfg = load_config(model_name="ling2-tiny", mtp_num_layers=0, base_num_decoder_layers=2, first_num_dense_layers=2,
                      inhomogeneous_layer_cycle_interval=1, vocab_size=512)
    m = decoder.Ling2Decoder(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    gdef, state = nnx.split(m)
    B, S = 2, 128
    ids = jax.ShapeDtypeStruct((B, S), np.int32)
    f = jax.jit(lambda state, ids: nnx.merge(gdef, state)(ids).logits)
    xla = f.lower(state, ids).compile().cost_analysis()["flops"]
    ours = model_lib.training_flops_per_token(ModelSpec.of(cfg), S) / 3 * B * S
    assert abs(xla / ours - 1) < 0.1, (xla, ours)


def _batch(cfg, B=2, T=12, seed=0):
    r = np.random.default_rng(seed)
    ids = jnp.asarray(r.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)
    w = jnp.ones((B, T), jnp.float32).at[:, -1].set(0)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    return ids, targets, w, pos, seg


def test_forward_without_targets_returns_logits_with_mtp_layers():
    cfg = load_config(model_name="ling2-micro", vocab_size=256)
    assert cfg.mtp_num_layers == 1
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    ids, *_ = _batch(cfg)
    out = nnx.jit(lambda m, ids: m(ids))(model, ids)
    assert out.logits.shape == (2, 12, 256) and out.logits.dtype == np.float32
    plain = nnx.jit(lambda d, ids: d(ids))(model.decoder, ids)  # the decoder alone, MTP not run
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(plain.logits))


def test_loss_sums_are_the_decoder_ce_plus_mtp_sums():
    """The reference: cross_entropy_sums of the decoder's own logits, and MTP called by hand."""
    cfg = load_config(model_name="ling2-micro", vocab_size=256)
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    batch = _batch(cfg)
    s = nnx.jit(lambda m, *b: m.loss_sums(*b))(model, *batch)
    ids, targets, w, pos, seg = batch
    out = model(ids, pos, seg)
    ce, n, hits = losses.cross_entropy_sums(out.logits, targets, w)
    np.testing.assert_allclose([float(s.ce), float(s.tokens), float(s.hits)], [float(ce), float(n), float(hits)],
                               rtol=1e-6)
    d = model.decoder
    mo = model.mtp(d, out, ids, targets, w, pos, seg)
    np.testing.assert_allclose(np.asarray(s.mtp.ce_sum), np.asarray(mo.ce_sum), rtol=1e-6)
    assert sorted(s.moe_aux) == [s_.index for s_ in ModelSpec.of(cfg).plan.all() if s_.mlp == "moe"] == [1, 2]


@pytest.mark.parametrize("scan", [False, True])
def test_expert_biases_follow_the_plan(scan):
    """Every MoE layer's bias once, with its global index; scanned stacks give one row per group."""
    cfg = load_config(model_name="ling2-tiny", scan_layers=scan, base_num_decoder_layers=12)
    model = nnx.eval_shape(lambda: Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0)))
    rows = [(tuple(var.shape), idx) for var, idx in model.expert_biases()]
    assert sorted(i for _, idx in rows for i in idx) == [i for i in range(13) if i != 0]  # layer 0 dense; 12 = MTP
    for shape, idx in rows:
        assert shape == ((len(idx), cfg.num_experts) if len(shape) == 2 else (cfg.num_experts,))
    if scan:  # 12 layers, groups of 5 after the dense prefix [0, 5): one group [5, 10) stacked, suffix 10, 11
        assert ((1, 16), [5]) in rows and ((16,), [10]) in rows


def test_vocab_blocked_loss_equals_full_logits_main_and_mtp():
    """loss_vocab_blocks > 0 (logits never held) against 0 (full logits), same weights: the main and MTP sums
    to 1e-6 and every parameter gradient to 3e-6 of its largest entry in fp32 (the loss alone is held to
    1e-6 in losses_test; through the layers fp32 summation order moves a few entries to ~1.3e-6)."""
    cfg = load_config(model_name="ling2-micro", vocab_size=1000, dtype="float32")
    batch = _batch(cfg, seed=3)
    results = []
    for blocks in (0, 3):
        model = Ling2Model(ModelSpec.of(cfg.model_copy(update={"loss_vocab_blocks": blocks})), rngs=nnx.Rngs(0))

        def loss(m):
            s = m.loss_sums(*batch)
            return s.ce + jnp.sum(s.mtp.ce_sum), s

        (_, s), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        results.append((s, g))
    (s0, g0), (s1, g1) = results
    np.testing.assert_allclose([float(s1.ce), float(s1.hits)], [float(s0.ce), float(s0.hits)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s1.mtp.ce_sum), np.asarray(s0.mtp.ce_sum), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=3e-6 * max(float(np.abs(a).max()), 1e-30))
