"""Ling2 decoder: layer plan, scan == unrolled (outputs and grads), remat policies, causality,
packing isolation, bf16 vs fp32, logical names on every parameter."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers import decoder
from ling2.config.specs import PlanSpec
from ling2.layers.plan import layer_plan, scan_layout
from ling2.config.specs import GLASpec
from ling2.layers.spec import ModelSpec

# 7 layers in groups of 2 (GLA + MLA): layer 0 dense -> prefix [0, 2), scanned groups
# [2, 4) and [4, 6), suffix [6] (a trailing partial group, MLA).
SMALL = dict(model_name="ling2-tiny", vocab_size=64, base_emb_dim=32, base_mlp_dim=48, base_num_query_heads=2,
             base_num_kv_heads=2, head_dim=16, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, num_experts=8, num_experts_per_tok=2, n_routing_groups=2, topk_routing_group=1,
             base_moe_mlp_dim=16, moe_shared_expert_dim=16, base_num_decoder_layers=7,
             inhomogeneous_layer_cycle_interval=2, gla_chunk_size=8, dtype="float32", init_std=0.1)


def small(**kw):
    return load_config(**{**SMALL, **kw})


def ids(B=2, T=16, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 64, (B, T)), jnp.int32)


def loss_fn(m, ids_BT, pos=None, seg=None):
    out = m(ids_BT, pos, seg)
    return jnp.mean(out.logits ** 2) + sum(a.loss for a in out.moe_aux.values()), out


# Rows of one length (one compile): [doc1 | doc2], [doc2 | filler], [doc1 | filler].
D1, D2, FILL = (np.random.default_rng(s).integers(0, 64, n) for s, n in ((1, 10), (2, 14), (3, 14)))
ROWS = jnp.asarray(np.stack([np.r_[D1, D2], np.r_[D2, FILL[:10]], np.r_[D1, FILL]]), jnp.int32)
SEG = jnp.asarray([[1] * 10 + [2] * 14, [2] * 14 + [3] * 10, [1] * 10 + [3] * 14])
POS = jnp.asarray([list(range(10)) + list(range(14)), list(range(14)) + list(range(10)),
                   list(range(10)) + list(range(14))])
GRAD = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))


def by_layer(state, cfg):
    """Flat {('layers', i, ...): array} from an unrolled or a scanned model's state."""
    out = {}
    p, n, k = scan_layout(PlanSpec.of(cfg))
    for path, v in nnx.to_flat_state(state):
        v = np.asarray(v[...] if hasattr(v, "get_metadata") else v)
        if path[0] == "layers":
            out[path] = v
        elif path[0] == "prefix":
            out[("layers", path[1], *path[2:])] = v
        elif path[0] == "suffix":
            out[("layers", p + n * k + path[1], *path[2:])] = v
        elif path[0] == "groups":
            for g in range(n):
                out[("layers", p + g * k + path[2], *path[3:])] = v[g]
        else:
            out[path] = v
    return out


def test_scan_plan_and_layer_types():
    cfg = small()
    assert cfg.layer_types == ("gla", "mla") * 3 + ("mla",)
    assert scan_layout(PlanSpec.of(cfg)) == (2, 2, 2)
    assert scan_layout(PlanSpec.of(small(first_num_dense_layers=0))) == (0, 3, 2)
    assert scan_layout(PlanSpec.of(small(first_num_dense_layers=3))) == (4, 1, 2)
    ling2 = load_config(model_name="ling2")
    assert scan_layout(PlanSpec.of(ling2)) == (5, 3, 5)  # layer 0 dense -> its group unscanned


def test_layer_plan_places_every_layer():
    """Hand-written plan of SMALL scanned: prefix [0, 2), groups of 2 at [2, 6), suffix [6]."""
    plan = ModelSpec.of(small(scan_layers=True, mtp_num_layers=1)).plan
    got = [(s.index, s.attn, s.mlp, s.path, s.stack) for s in plan.all()]
    assert got == [(0, "gla", "dense", ("decoder", "prefix", 0), ()), (1, "mla", "moe", ("decoder", "prefix", 1), ()),
                   (2, "gla", "moe", ("decoder", "groups", "layers", 0), (0,)),
                   (3, "mla", "moe", ("decoder", "groups", "layers", 1), (0,)),
                   (4, "gla", "moe", ("decoder", "groups", "layers", 0), (1,)),
                   (5, "mla", "moe", ("decoder", "groups", "layers", 1), (1,)),
                   (6, "mla", "moe", ("decoder", "suffix", 0), ()),
                   (7, "mla", "moe", ("mtp", "depths", 0, "layer"), ())]
    flat = ModelSpec.of(small(mtp_num_layers=0)).plan
    assert [s.path for s in flat.all()] == [("decoder", "layers", i) for i in range(7)] and not flat.scan
    with pytest.raises(ValueError, match="one pattern"):  # scanned groups must repeat one layer pattern
        layer_plan(types.SimpleNamespace(num_decoder_layers=4, inhomogeneous_layer_cycle_interval=2,
                                         first_num_dense_layers=0, layer_types=("gla", "mla", "mla", "gla"),
                                         mlp_types=("moe",) * 4, mtp_num_layers=0), scan=True)


@pytest.fixture(scope="module")
def both():
    # 5 MoE layers: scanned groups [0, 2), [2, 4) and suffix [4]; remat must not change grads.
    kw = dict(base_num_decoder_layers=5, first_num_dense_layers=0)
    cfgs = {False: small(**kw), True: small(scan_layers=True, remat_policy="full", **kw)}
    models = {s: decoder.Ling2Decoder(ModelSpec.of(c), rngs=nnx.Rngs(0)) for s, c in cfgs.items()}
    return cfgs, models, {s: GRAD(m, ROWS, POS, SEG) for s, m in models.items()}


def test_scan_equals_unrolled(both):
    cfgs, models, res = both
    assert by_layer(nnx.state(models[True], nnx.Param), cfgs[True]).keys() == \
        by_layer(nnx.state(models[False], nnx.Param), cfgs[False]).keys()
    (lu, ou), gu = res[False]
    (ls, os_), gs = res[True]
    np.testing.assert_allclose(ls, lu, rtol=1e-6)
    np.testing.assert_allclose(os_.logits, ou.logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(os_.hidden, ou.hidden, rtol=1e-5, atol=1e-6)
    assert sorted(os_.moe_aux) == sorted(ou.moe_aux) == list(range(5))
    for i in ou.moe_aux:
        np.testing.assert_array_equal(os_.moe_aux[i].counts, ou.moe_aux[i].counts)
    gu, gs = by_layer(gu, cfgs[False]), by_layer(gs, cfgs[True])
    assert gu.keys() == gs.keys()
    for k in gu:
        np.testing.assert_allclose(gs[k], gu[k], rtol=1e-4, atol=1e-5 * np.abs(gu[k]).max(), err_msg=str(k))


def test_one_call_path_gives_every_layer_its_index(both):
    """`fold` hands every layer its global index (traced inside the scan) in order, `unstacked` lists the same
    layers, and a layer sliced out of a scanned group is the unscanned model's layer, weight for weight."""
    cfgs, models, _ = both
    L = cfgs[False].base_num_decoder_layers
    for scan, model in models.items():
        kinds = []

        def f(layer, i, x, extras):
            kinds.append(layer.attn_type)
            return x + 1, jnp.asarray(i)

        x, seen = model.fold(f, jnp.zeros((), jnp.int32))
        assert int(x) == L and {i: int(v) for i, v in seen.items()} == {i: i for i in range(L)}
        assert [i for i, _ in model.unstacked()] == list(range(L))
        # a scanned group's layers are traced once for all its groups
        assert kinds == (["gla", "mla", "mla"] if scan else list(cfgs[False].layer_types))
    unrolled = dict(models[False].unstacked())
    for i, layer in models[True].unstacked():
        assert layer.attn_type == unrolled[i].attn_type
        for a, b in zip(jax.tree.leaves(nnx.state(layer)), jax.tree.leaves(nnx.state(unrolled[i]))):
            np.testing.assert_array_equal(a, b)


def test_scanned_gla_layers_decay_by_their_own_index():
    """GLA's decays follow the layer index it is given, traced or not: -slopes of the reference formula
    base_h * (1 - (i - 1) / (L - 1) + 1e-5) (hand-written here; `attention_gla_test` checks the base slopes)."""
    from ling2.layers.attention.gla import GatedLinearAttention, alibi_base_slopes

    cfg = small()
    layer = GatedLinearAttention(GLASpec.of(cfg), rngs=nnx.Rngs(0))
    L, H = cfg.base_num_decoder_layers, cfg.base_num_query_heads
    for i in (0, 2, 4):
        want = -(alibi_base_slopes(H) * (1 - (i - 1) / (L - 1) + 1e-5)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(layer.decay(i)), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(layer.decay)(jnp.int32(i))), want)
    with pytest.raises(ValueError, match="layer_index=7"):
        layer.decay(7)


def test_remat_policies_same_grads():
    """On a GLA + MLA pair with dense MLPs: 'full' and 'save_dot' give the loss and grads of 'none'.
    (Scanned layers under 'full' are covered by test_scan_equals_unrolled.)"""
    res = {}
    for policy in ("none", "full", "save_dot"):
        cfg = small(remat_policy=policy, base_num_decoder_layers=2, first_num_dense_layers=2)
        m = decoder.Ling2Decoder(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
        (loss, _), g = GRAD(m, ROWS, POS, SEG)
        res[policy] = loss, by_layer(g, cfg)
        gdef, st = nnx.split(m)
        jaxpr = str(jax.make_jaxpr(lambda st: loss_fn(nnx.merge(gdef, st), ROWS, POS, SEG)[0])(st))
        assert ("remat" in jaxpr) == (policy != "none"), policy
    for policy in ("full", "save_dot"):
        np.testing.assert_allclose(res[policy][0], res["none"][0], rtol=1e-6)
        for k, v in res[policy][1].items():
            ref = res["none"][1][k]
            np.testing.assert_allclose(v, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=f"{policy} {k}")


def test_packing_isolation(both):
    """Each document's logits in a packed row equal its logits alone (GLA and MLA layers)."""
    for scan in (False, True):
        out = np.asarray(both[2][scan][0][1].logits)
        np.testing.assert_allclose(out[0, 10:], out[1, :14], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out[0, :10], out[2, :10], rtol=1e-4, atol=1e-5)


def test_causality(both):
    """Changing tokens from position 17 on leaves earlier logits unchanged."""
    _, models, res = both
    future = ROWS.at[:, 17:].set((ROWS[:, 17:] + 7) % 64)
    (_, out), _ = GRAD(models[True], future, POS, SEG)
    ref = np.asarray(res[True][0][1].logits)
    np.testing.assert_allclose(np.asarray(out.logits)[:, :17], ref[:, :17], rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out.logits)[:, 17:], ref[:, 17:])


def test_bf16_forward_finite_and_close():
    """bf16 logits are finite and within a few % of fp32. A MoE router can flip a near-tie expert
    choice under bf16 (a legitimately different output for that token), so with MoE the bound is
    on the median token, and the whole-tensor bound is checked on a dense-MLP model."""
    x = ids()
    for kw, typical in ((dict(first_num_dense_layers=2), np.mean), (dict(first_num_dense_layers=1), np.median)):
        out = {}
        for dt in ("float32", "bfloat16"):
            m = decoder.Ling2Decoder(ModelSpec.of(small(dtype=dt, base_num_decoder_layers=2, **kw)), rngs=nnx.Rngs(0))
            out[dt] = np.asarray(nnx.jit(lambda m, x: m(x).logits)(m, x), np.float32)
        assert np.isfinite(out["bfloat16"]).all()
        err_tok = np.mean((out["bfloat16"] - out["float32"]) ** 2, -1) / np.mean(out["float32"] ** 2)
        assert np.sqrt(typical(err_tok)) < 0.03, (kw, np.sqrt(err_tok))


def test_every_param_has_logical_names(both):
    for m in both[1].values():
        for path, v in nnx.to_flat_state(nnx.state(m, nnx.Param)):
            names = v.get_metadata().get("out_sharding")
            assert names is not None and len(names) == v.ndim, (path, names, v.shape)
            assert (path[0] == "groups") == (names[0] == "layers"), (path, names)


def test_unknown_remat_policy_is_named():
    with pytest.raises(ValueError, match="remat_policy"):
        decoder.remat(lambda x: x, "some")


def test_decode_with_cache_matches_full_forward(both):
    """Prefill 6 tokens, then 4 single steps: logits equal the full forward's (scanned model, so the
    stacked layers are sliced; GLA uses its recurrent state, MLA its latent KV cache)."""
    _, models, res = both
    m = models[True]
    step = nnx.jit(lambda m, mode, ids, pos, cache: m.decode(mode, ids, pos, cache), static_argnames="mode")
    row = ROWS[2:3, :10]  # document 1 alone, positions 0..9
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    out, cache = step(m, "prefill", row[:, :6], pos[:, :6], m.init_cache(1, 16))
    logits = [np.asarray(out.logits)]
    for t in range(6, 10):
        out, cache = step(m, "step", row[:, t:t + 1], pos[:, t:t + 1], cache)
        logits.append(np.asarray(out.logits))
    ref = np.asarray(res[True][0][1].logits)[2:3, :10]
    np.testing.assert_allclose(np.concatenate(logits, 1), ref, rtol=1e-4, atol=1e-5)
