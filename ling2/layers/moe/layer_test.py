"""MoE layer tests. References: a per-token float64 numpy loop written below from the math in
shared/docs/model.md (MoE section), hand-computed cases, and the ST-MoE / loss-free-balancing
formulas written plainly."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers.moe import layer as moe
from ling2.layers.moe import experts as moe_experts
from ling2.kernels.moe import gmm as moe_gmm
from ling2.layers.moe import plan as moe_plan
from ling2.layers.moe import router as moe_router
from ling2.layers.moe.layer import MoE, MoEAux, bias_update
from ling2.layers.moe.router import RoutedBias
from ling2.config.specs import MoESpec


def tiny(**kw):
    return load_config(model_name="ling2-tiny", **kw)


@nnx.jit
def call(m, x, valid=None):
    """One compile per test instead of one per eager op."""
    return m(x, valid)


# ---- float64 reference ---------------------------------------------------------------------------

def ref_route(x_TD, kernel_DE, bias_E, cfg):
    """Per token: scores, group-limited top-k on biased scores, weights from unbiased scores, divided by
    their sum where the config renormalises (sigmoid: HF norm_topk_prob, softmax: norm_topk_prob)."""
    logits = x_TD.astype(np.float64) @ kernel_DE.astype(np.float64)
    E, K, G = cfg.num_experts, cfg.num_experts_per_tok, cfg.n_routing_groups
    experts, weights = [], []
    for l in logits:
        if cfg.routed_score_func == "sigmoid":
            s = 1 / (1 + np.exp(-l))
        else:
            s = np.exp(l - l.max()) / np.exp(l - l.max()).sum()
        c = s + bias_E
        per = E // G
        gscore = [sorted(c[g * per:(g + 1) * per])[-2:] for g in range(G)]
        gscore = np.array([sum(v) for v in gscore])
        kept = sorted(range(G), key=lambda g: (-gscore[g], g))[:cfg.topk_routing_group] if G > 1 else [0]
        allowed = [e for e in range(E) if e // per in kept]
        top = sorted(allowed, key=lambda e: (-c[e], e))[:K]
        w = s[top]
        sigmoid = cfg.routed_score_func == "sigmoid"
        if (sigmoid and cfg.sigmoid_renormalize) or (not sigmoid and cfg.norm_topk_prob):
            w = w / w.sum()
        experts.append(top)
        weights.append(w * cfg.routed_scaling_factor)
    return np.array(experts), np.array(weights), logits


def silu(v):
    return v / (1 + np.exp(-v))


def ref_swiglu(x, wg, wu, wd):
    return (silu(x @ wg) * (x @ wu)) @ wd


def ref_moe(m: MoE, x_TD, dropped=None):
    """Output [T, D] in float64: sum_k w_k expert_k(x) + shared(x); skips (t, k) in `dropped`."""
    cfg = m.spec
    f64 = lambda p: np.asarray(p[...], np.float64)
    bias = f64(m.gate.expert_bias) if m.gate.expert_bias is not None else np.zeros(cfg.num_experts)
    experts, weights, _ = ref_route(np.asarray(x_TD, np.float64), f64(m.gate.kernel), bias, cfg)
    wg, wu, wd = f64(m.experts.gate_proj), f64(m.experts.up_proj), f64(m.experts.down_proj)
    x = np.asarray(x_TD, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k, e in enumerate(experts[t]):
            if dropped is None or not dropped[t, k]:
                out[t] += weights[t, k] * ref_swiglu(x[t], wg[e], wu[e], wd[e])
    if m.shared_experts is not None:
        s = m.shared_experts
        out += ref_swiglu(x, f64(s.gate_proj), f64(s.up_proj), f64(s.down_proj))
    return out, experts


def randomize_bias(m, seed=3, scale=0.05):
    m.gate.expert_bias[...] = jax.random.normal(jax.random.key(seed), m.gate.expert_bias.shape) * scale


# ---- routing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("score_func,norm", [("sigmoid", False), ("softmax", False), ("softmax", True)])
@pytest.mark.parametrize("sigmoid_renorm", [True, False])
def test_routing_matches_numpy_loop(score_func, norm, sigmoid_renorm):
    cfg = tiny(routed_score_func=score_func, norm_topk_prob=norm, sigmoid_renormalize=sigmoid_renorm)
    x = np.asarray(jax.random.normal(jax.random.key(0), (24, cfg.base_emb_dim)))
    kernel = np.asarray(jax.random.normal(jax.random.key(1), (cfg.base_emb_dim, cfg.num_experts)) * 0.1)
    bias = np.asarray(jax.random.normal(jax.random.key(2), (cfg.num_experts,)) * 0.05)
    r = moe_router.route(jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(bias), cfg)
    e_ref, w_ref, l_ref = ref_route(x, kernel, bias, cfg)
    np.testing.assert_array_equal(np.asarray(r.experts_TK), e_ref)
    np.testing.assert_allclose(np.asarray(r.weights_TK), w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(r.logits_TE), l_ref, rtol=1e-5, atol=1e-5)


def test_ties_go_to_lower_index():
    choice = jnp.full((1, 8), 0.5)
    np.testing.assert_array_equal(moe_router.select_experts(choice, 3, 1, 1), [[0, 1, 2]])
    # four groups of two, all tied: the first two groups are kept.
    np.testing.assert_array_equal(moe_router.select_experts(choice, 4, 4, 2), [[0, 1, 2, 3]])


def test_group_masked_out_even_with_best_expert():
    # groups of 2: g0=[.99,.0] (top-2 sum .99), g1=[.6,.6] (1.2), g2=[.55,.5] (1.05), g3=[.1,.1]
    choice = jnp.array([[0.99, 0.0, 0.6, 0.6, 0.55, 0.5, 0.1, 0.1]])
    got = moe_router.select_experts(choice, 3, 4, 2)
    np.testing.assert_array_equal(got, [[2, 3, 4]])  # expert 0 (0.99) is in a dropped group
    np.testing.assert_array_equal(moe_router.select_experts(choice, 3, 1, 1), [[0, 2, 3]])


def test_biased_selection_unbiased_weights():
    cfg = tiny(num_experts=4, num_experts_per_tok=2, n_routing_groups=1, topk_routing_group=1,
               routed_scaling_factor=1.0)
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    # x @ I picks the logits; the bias lifts expert 3 past experts 1 and 2.
    r = moe_router.route(jnp.asarray(logits[None]), jnp.eye(4), jnp.array([0.0, 0.0, 0.0, 1.0]), cfg)
    np.testing.assert_array_equal(r.experts_TK, [[3, 0]])
    s = 1 / (1 + np.exp(-logits))
    np.testing.assert_allclose(r.weights_TK, [[s[3] / (s[3] + s[0]), s[0] / (s[3] + s[0])]], rtol=1e-6)


def test_softmax_vs_sigmoid_weights():
    logits = np.array([[1.0, 0.5, -0.5, -1.0]])
    kw = dict(num_experts=4, num_experts_per_tok=2, n_routing_groups=1, topk_routing_group=1,
              routed_scaling_factor=2.0)
    sig = moe_router.route(jnp.asarray(logits), jnp.eye(4), None, tiny(routed_score_func="sigmoid", **kw))
    s = 1 / (1 + np.exp(-logits[0, :2]))
    np.testing.assert_allclose(sig.weights_TK[0], 2.0 * s / s.sum(), rtol=1e-6)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    soft = moe_router.route(jnp.asarray(logits), jnp.eye(4), None, tiny(routed_score_func="softmax", **kw))
    np.testing.assert_allclose(soft.weights_TK[0], 2.0 * p[:2], rtol=1e-6)  # not normalised
    norm = moe_router.route(jnp.asarray(logits), jnp.eye(4), None,
                            tiny(routed_score_func="softmax", norm_topk_prob=True, **kw))
    np.testing.assert_allclose(norm.weights_TK[0], 2.0 * p[:2] / p[:2].sum(), rtol=1e-6)


def test_unnormalised_sigmoid_weights_are_the_scaled_scores():
    """sigmoid_renormalize false (HF norm_topk_prob / moe_renormalize false): the chosen sigmoid scores times
    routed_scaling_factor, not divided by their sum; norm_topk_prob has no say over sigmoid weights."""
    logits = np.array([[1.0, 0.5, -0.5, -1.0], [-2.0, 0.25, 3.0, 0.0]])
    kw = dict(num_experts=4, num_experts_per_tok=2, n_routing_groups=1, topk_routing_group=1,
              routed_scaling_factor=2.5, routed_score_func="sigmoid")
    s = 1 / (1 + np.exp(-logits))
    want = 2.5 * np.array([[s[0, 0], s[0, 1]], [s[1, 2], s[1, 1]]])
    for norm in (False, True):
        r = moe_router.route(jnp.asarray(logits), jnp.eye(4), None,
                             tiny(sigmoid_renormalize=False, norm_topk_prob=norm, **kw))
        np.testing.assert_array_equal(r.experts_TK, [[0, 1], [2, 1]])
        np.testing.assert_allclose(r.weights_TK, want, rtol=1e-6)
    r = moe_router.route(jnp.asarray(logits), jnp.eye(4), None, tiny(sigmoid_renormalize=True, **kw))
    np.testing.assert_allclose(r.weights_TK, want / want.sum(-1, keepdims=True) * 2.5, rtol=1e-6)


# ---- full layer -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,renorm", [("tiled", True), ("ragged_dot", True), ("blocked", True), ("megablox", True),
                                         ("pallas_gpu", True), ("dense", True),
                                         ("tiled", False), ("dense", False)])
def test_output_matches_numpy_loop(path, renorm):
    cfg = tiny(sparse_matmul=path != "dense", capacity_factor=-1.0, sigmoid_renormalize=renorm,
               **({"base_moe_mlp_dim": 128} if path == "megablox" else {}))
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0), gmm=None if path == "dense" else path)
    randomize_bias(m)
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.base_emb_dim))
    y, aux = call(m, x)
    ref, experts = ref_moe(m, np.asarray(x).reshape(12, -1))
    np.testing.assert_allclose(np.asarray(y).reshape(12, -1), ref, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(aux.counts, np.bincount(experts.ravel(), minlength=cfg.num_experts))
    assert float(aux.stats["dropped"]) == 0


@pytest.mark.parametrize("renorm", [True, False])
def test_decode_sized_input_gathers_experts_and_matches_numpy_loop(monkeypatch, renorm):
    cfg = tiny(sigmoid_renormalize=renorm)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0), gmm="tiled")
    randomize_bias(m)
    x = jax.random.normal(jax.random.key(2), (2, 2, cfg.base_emb_dim))  # T*K = 16 = E assignments: gathered
    monkeypatch.setattr(moe_plan, "grouped_ffn", lambda *a: (_ for _ in ()).throw(AssertionError("grouped")))
    y, _ = nnx.jit(lambda m, x: m(x))(m, x)
    ref, _ = ref_moe(m, np.asarray(x).reshape(4, -1))
    np.testing.assert_allclose(np.asarray(y).reshape(4, -1), ref, rtol=1e-4, atol=1e-6)


def test_ragged_equals_dense_at_high_capacity():
    cfg = tiny()
    x = jax.random.normal(jax.random.key(4), (2, 8, cfg.base_emb_dim))
    ys = []
    for sparse, cf in [(True, -1.0), (False, float(cfg.num_experts))]:
        m = MoE(MoESpec.of(cfg.model_copy(update=dict(sparse_matmul=sparse, capacity_factor=cf))), rngs=nnx.Rngs(0))
        ys.append(np.asarray(call(m, x)[0]))
    np.testing.assert_allclose(ys[0], ys[1], rtol=1e-5, atol=1e-6)


def ref_kept(experts_SK, E, cap):
    """Slot-major queueing per expert: all first choices in position order, then second, ..."""
    S, K = experts_SK.shape
    used, kept = np.zeros(E, int), np.zeros((S, K), bool)
    for k in range(K):
        for s in range(S):
            e = experts_SK[s, k]
            if used[e] < cap:
                used[e] += 1
                kept[s, k] = True
    return kept


def test_dense_path_drops_expected_tokens():
    cfg = tiny(sparse_matmul=False, capacity_factor=0.5)
    S = 16
    cap = moe_experts.capacity(S, cfg.num_experts_per_tok, cfg.num_experts, 0.5)
    assert cap == math.ceil(S * 4 / 16 * 0.5) == 2
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(5), (1, S, cfg.base_emb_dim))
    y, aux = call(m, x)
    experts = ref_moe(m, np.asarray(x)[0])[1]
    kept = ref_kept(experts, cfg.num_experts, cap)
    assert (~kept).sum() > 0
    ref, _ = ref_moe(m, np.asarray(x)[0], dropped=~kept)
    np.testing.assert_allclose(np.asarray(y)[0], ref, rtol=1e-4, atol=1e-6)
    assert float(aux.stats["dropped"]) == (~kept).sum()
    np.testing.assert_allclose(aux.metrics(4)["dropped_frac"], (~kept).mean(), rtol=1e-6)


def test_fp32_router_under_bf16_compute():
    cfg = tiny(dtype="bfloat16")
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(6), (1, 8, cfg.base_emb_dim)).astype(jnp.bfloat16)
    r = m.gate(x.reshape(8, -1))
    assert r.logits_TE.dtype == jnp.float32 and r.weights_TK.dtype == jnp.float32
    ref = np.asarray(x, np.float64).reshape(8, -1) @ np.asarray(m.gate.kernel[...], np.float64)
    np.testing.assert_allclose(r.logits_TE, ref, rtol=1e-5, atol=1e-6)  # a bf16 matmul would be off ~1e-2
    y, _ = call(m, x)
    assert y.dtype == jnp.bfloat16


@pytest.mark.parametrize("dim,n,width", [(0, 1, 64), (128, 1, 128), (128, 2, 256), (128, 0, 0)])
def test_shared_expert_width_and_fallback(dim, n, width):
    m = MoE(MoESpec.of(tiny(moe_shared_expert_dim=dim, shared_experts=n)), rngs=nnx.Rngs(0))
    if width == 0:
        assert m.shared_experts is None
    else:
        assert m.shared_experts.gate_proj.shape == (128, width)
        assert m.shared_experts.down_proj.shape == (width, 128)


def test_params_have_known_logical_axes_and_bias_is_not_a_param():
    cfg = tiny()
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    rules = {name for name, _ in cfg.logical_axis_rules}
    params = nnx.state(m, nnx.Param)
    for path, v in nnx.to_flat_state(params):
        names = v.get_metadata().get("out_sharding")
        assert names is not None and len(names) == v.ndim, path
        assert all(n is None or n in rules for n in names), (path, names)
    assert m.experts.gate_proj.get_metadata()["out_sharding"] == ("exp", "embed", "mlp")
    assert not any("expert_bias" in str(p) for p, _ in nnx.to_flat_state(params))
    biases = nnx.to_flat_state(nnx.state(m, RoutedBias))
    assert len(biases) == 1 and biases[0][1].dtype == jnp.float32


def test_gradients_flow_and_bias_gets_none():
    cfg = tiny(load_balance_loss_weight=0.01, moe_z_loss_weight=0.001)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(7), (1, 8, cfg.base_emb_dim))

    def loss(m):
        y, aux = call(m, x)
        return (y ** 2).sum() + aux.loss

    grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, RoutedBias))))(m)
    for path, g in nnx.to_flat_state(grads):
        assert np.isfinite(g[...]).all(), path
        if "expert_bias" in str(path):
            assert not np.asarray(g[...]).any()
        elif "kernel" in str(path) or "shared" in str(path):
            assert np.asarray(g[...]).any(), path


def test_valid_mask_excludes_padding_from_counts_and_stats():
    cfg = tiny()
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(8), (1, 8, cfg.base_emb_dim))
    valid = jnp.arange(8)[None] < 5
    _, aux = call(m, x, valid)
    _, aux5 = call(m, x[:, :5])
    np.testing.assert_array_equal(aux.counts, aux5.counts)
    assert int(aux.counts.sum()) == 5 * cfg.num_experts_per_tok
    for k in aux5.stats:
        np.testing.assert_allclose(aux.stats[k], aux5.stats[k], rtol=1e-5)


# ---- losses, stats, balancing ---------------------------------------------------------------------

def test_z_loss_formula_and_skipped_at_zero_weight():
    cfg = tiny(moe_z_loss_weight=0.1)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(9), (1, 6, cfg.base_emb_dim))
    _, aux = call(m, x)
    logits = np.asarray(x, np.float64)[0] @ np.asarray(m.gate.kernel[...], np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(aux.z_loss, 0.1 * np.mean(lse ** 2), rtol=1e-5)
    np.testing.assert_allclose(aux.metrics(4)["z_loss"], np.mean(lse ** 2), rtol=1e-5)
    # hand case: logits [0, 0] -> lse = log 2; [log 3, 0] -> lse = log 4
    np.testing.assert_allclose(moe_router.z_loss_sum(jnp.array([[0.0, 0.0], [math.log(3), 0.0]])),
                               math.log(2) ** 2 + math.log(4) ** 2, rtol=1e-6)
    _, aux0 = call(MoE(MoESpec.of(tiny(moe_z_loss_weight=0.0)), rngs=nnx.Rngs(0)), x)
    assert float(aux0.z_loss) == 0 and "lse_sq_sum" not in aux0.stats and "z_loss" not in aux0.metrics(4)


def test_load_balance_loss():
    # Balanced: 2 tokens, uniform scores, one assignment each to 2 experts -> loss 1.
    s = jnp.full((2, 2), 0.5)
    np.testing.assert_allclose(moe_router.load_balance_loss(s, jnp.array([1, 1])), 1.0, rtol=1e-6)
    # General: E * sum f_e P_e with P from per-token normalised scores.
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.8, 0.6]])
    counts = np.array([2, 1, 1])
    p = scores / scores.sum(1, keepdims=True)
    want = 3 * np.sum(counts / 4 * p.mean(0))
    np.testing.assert_allclose(moe_router.load_balance_loss(jnp.asarray(scores), jnp.asarray(counts)), want,
                               rtol=1e-6)
    cfg = tiny(load_balance_loss_weight=0.5)
    _, aux = call(MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0)), jax.random.normal(jax.random.key(1), (1, 4, cfg.base_emb_dim)))
    assert 0 < float(aux.lb_loss) and float(aux.z_loss) == 0


def test_bias_update_and_zero_mean():
    counts = jnp.array([1, 2, 3, 6])  # mean 3 -> sign(3 - c) = [1, 1, 0, -1]
    b = jnp.array([0.1, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(moe_router.update_routed_bias(b, counts, 0.01, False), [0.11, 0.01, 0.0, -0.01],
                               rtol=1e-6)
    np.testing.assert_allclose(moe_router.update_routed_bias(b, counts, 0.01, True),
                               np.array([0.11, 0.01, 0.0, -0.01]) - 0.0275, rtol=1e-5, atol=1e-7)
    out = moe_router.update_routed_bias(b.astype(jnp.bfloat16), counts, 0.01, True)
    assert out.dtype == jnp.bfloat16
    cfg = tiny(routed_bias_update_rate=0.5, routed_bias_zero_mean_update=False)
    np.testing.assert_allclose(bias_update(jnp.zeros(4), counts, cfg), [0.5, 0.5, 0.0, -0.5])


def test_counts_and_stats_sum_over_micro_batches():
    cfg = tiny(moe_z_loss_weight=0.01)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    randomize_bias(m)
    x = jax.random.normal(jax.random.key(10), (2, 8, cfg.base_emb_dim))
    _, a1 = call(m, x[:1])
    _, a2 = call(m, x[1:])
    _, full = call(m, x)
    summed = jax.tree.map(lambda a, b: a + b, a1, a2)
    np.testing.assert_array_equal(summed.counts, full.counts)
    for k, v in full.metrics(4).items():
        np.testing.assert_allclose(summed.metrics(4)[k], v, rtol=1e-5, err_msg=k)
    bias = m.gate.expert_bias[...]
    np.testing.assert_allclose(bias_update(bias, summed.counts, cfg), bias_update(bias, full.counts, cfg))
    assert isinstance(summed, MoEAux)


def test_router_metrics_hand_case():
    counts = jnp.array([2, 4, 6, 0])
    sums = {"tokens": jnp.array(3.0), "entropy_sum": jnp.array(1.5), "topk_score_sum": jnp.array(0.9),
            "dropped": jnp.array(3.0)}
    got = moe_router.router_metrics(counts, sums, k=4)
    c = np.array([2, 4, 6, 0.0])
    want = {"tpe_min": 0, "tpe_max": 6, "tpe_cv": c.std() / 3, "max_violation": 1.0, "entropy": 0.5,
            "topk_score": 0.3, "dropped_frac": 0.25}
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)


def test_bad_gmm_name_is_an_error():
    with pytest.raises(ValueError, match="gmm"):
        call(MoE(MoESpec.of(tiny()), rngs=nnx.Rngs(0), gmm="nope"), jnp.zeros((1, 2, 128)))


def test_megablox_needs_dims_sharing_a_multiple_of_128():
    x, gs = jnp.zeros((16, 128)), jnp.array([16, 0], jnp.int32)
    w = (jnp.zeros((2, 128, 64)), jnp.zeros((2, 128, 64)), jnp.zeros((2, 64, 128)))
    with pytest.raises(ValueError, match=r"megablox needs the model dim \(128\) and expert width \(64"):
        jax.jit(lambda x, *w: moe_gmm.grouped_ffn(x, gs, w, "megablox"))(x, *w)  # traced for every platform
    assert moe_gmm.megablox_tile(2048, 512) == 512 and moe_gmm.megablox_tile(384, 128) == 128


# ---- grouped matmul implementations ---------------------------------------------------------------

def test_grouped_ffn_impls_and_grads_match_plain_reference():
    """Rows sorted by expert, an empty group, and rows past sum(group_sizes) (must give zeros);
    gradients against autodiff of a plain masked per-expert formula."""
    gs = jnp.array([7, 0, 13, 12, 3], jnp.int32)  # sum 35 of M = 40 rows
    M, D, F, E = 40, 8, 4, 5
    ks = jax.random.split(jax.random.key(11), 5)
    x = jax.random.normal(ks[0], (M, D))
    w = (jax.random.normal(ks[1], (E, D, F)), jax.random.normal(ks[2], (E, D, F)), jax.random.normal(ks[3], (E, F, D)))
    ct = jax.random.normal(ks[4], (M, D))
    expert_of_row = np.repeat(np.arange(E), np.asarray(gs))

    def plain(x, wg, wu, wd):
        onehot = jax.nn.one_hot(jnp.asarray(np.pad(expert_of_row, (0, M - 35), constant_values=E)), E)
        y = jnp.einsum("me,emd->md", onehot, jax.vmap(lambda a, b, c: moe_experts.swiglu(x, a, b, c))(wg, wu, wd))
        return y

    want = np.zeros((M, D))
    xn, wn = np.asarray(x, np.float64), [np.asarray(a, np.float64) for a in w]
    for m, e in enumerate(expert_of_row):
        want[m] = ref_swiglu(xn[m], wn[0][e], wn[1][e], wn[2][e])
    g_plain = jax.grad(lambda *a: jnp.sum(plain(*a) * ct), argnums=(0, 1, 2, 3))(x, *w)
    impls = {"tiled": lambda x, *w: moe_gmm.grouped_ffn(x, gs, w, "tiled"),
             "ragged_dot": lambda x, *w: moe_gmm.grouped_ffn(x, gs, w, "ragged_dot"),
             "blocked": lambda x, *w: moe_gmm.grouped_ffn(x, gs, w, "blocked"),
             "blocked_8_row_blocks": lambda x, *w: moe_gmm.ffn_blocked(x, gs, *w, block=8),
             "blocked_in_steps": lambda x, *w: moe_gmm.ffn_blocked(x, gs, *w, block=8, step_bytes=2 * 3 * D * F * 4),
             "megablox": lambda x, *w: moe_gmm.ffn_megablox(x, gs, *w, interpret=True),  # any dims interpreted
             "pallas_gpu": lambda x, *w: moe_gmm.grouped_ffn(x, gs, w, "pallas_gpu")}
    for gmm, impl in impls.items():
        f = jax.jit(impl)
        np.testing.assert_allclose(f(x, *w), want, rtol=1e-4, atol=1e-4, err_msg=gmm)
        g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2, 3)))(x, *w)
        for a, b, name in zip(g, g_plain, ("x", "wg", "wu", "wd")):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"{gmm} d{name}")


def test_layer_grads_dropless_equal_dense_path():
    """The sorted path (custom-VJP gathers and tiled matmul) against plain autodiff of the one-hot path."""
    x = jax.random.normal(jax.random.key(12), (2, 6, 128))
    ct = jax.random.normal(jax.random.key(13), x.shape)
    grads = []
    for sparse in (True, False):
        m = MoE(MoESpec.of(tiny(sparse_matmul=sparse, capacity_factor=-1.0)), rngs=nnx.Rngs(0), gmm="tiled")
        g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] * ct), argnums=(0, 1)))(m, x)
        grads.append(g)
    np.testing.assert_allclose(grads[0][1], grads[1][1], rtol=1e-4, atol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads[0][0]), nnx.to_flat_state(grads[1][0])):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-4, atol=1e-6, err_msg=str(path))


# ---- dropless dispatch: one sort, the combine in the activation dtype -----------------------------

def count_eqns(jaxpr, name: str) -> int:
    """Equations of primitive `name` in a jaxpr and every jaxpr nested in its equations' params."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    n += count_eqns(sub, name)
    return n


def routing(key, T: int, K: int, E: int, used: int):
    """Expert ids [T, K] drawn from `used` of the E experts (the others get no rows)."""
    k1, k2 = jax.random.split(key)
    ids_U = jax.random.choice(k1, E, (used,), replace=False)
    return ids_U[jax.random.randint(k2, (T, K), 0, used)]


@pytest.mark.parametrize("T,K,E,used", [(37, 4, 16, 5), (64, 8, 64, 64), (50, 1, 8, 3), (16, 2, 4, 1), (3, 8, 32, 20)])
def test_sort_by_expert_equals_double_argsort(T, K, E, used):
    """order_M is the stable argsort of the flattened ids, inv_M what a second argsort of it gave, the group
    sizes their bincount: on random routings with empty experts (used=1: every row to one expert)."""
    for seed in range(3):
        experts_TK = routing(jax.random.key(seed), T, K, E, used)
        order_M, inv_M, gs_E = jax.jit(moe_experts.sort_by_expert, static_argnums=1)(experts_TK, E)
        flat_M = np.asarray(experts_TK).reshape(-1)
        want_M = np.asarray(jnp.argsort(jnp.asarray(flat_M), stable=True))
        np.testing.assert_array_equal(want_M, np.argsort(flat_M, kind="stable"))
        np.testing.assert_array_equal(order_M, want_M)
        np.testing.assert_array_equal(inv_M, np.asarray(jnp.argsort(jnp.asarray(want_M))))
        np.testing.assert_array_equal(gs_E, np.bincount(flat_M, minlength=E))
        assert (np.asarray(gs_E) == 0).sum() >= E - used


@pytest.mark.parametrize("gmm", ["tiled", "ragged_dot", "blocked"])
def test_dropless_sorts_once_forward_and_backward(gmm):
    T, K, E, D, F = 24, 4, 8, 16, 8
    w = tuple(jnp.zeros(s) for s in [(E, D, F), (E, D, F), (E, F, D)])
    experts_TK = routing(jax.random.key(0), T, K, E, 6)

    def loss(x, weights_TK, w):
        return moe_experts.dropless(x, experts_TK, weights_TK, w, partial(moe_gmm.grouped_ffn, gemm=gmm)).sum()

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(jnp.zeros((T, D)), jnp.zeros((T, K)), w)
    assert count_eqns(jaxpr.jaxpr, "sort") == 1


@pytest.mark.parametrize("dtype,gmm", [("float32", "tiled"), ("bfloat16", "tiled"), ("bfloat16", "ragged_dot")])
def test_layer_output_and_grads_unchanged_by_single_sort(dtype, gmm, monkeypatch):
    """Output and every gradient bit for bit against the same layer whose inverse permutation is a second
    argsort; three experts biased out of every choice, so some groups are empty."""
    cfg = tiny(dtype=dtype, capacity_factor=-1.0, load_balance_loss_weight=0.01, moe_z_loss_weight=0.001)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0), gmm=gmm)
    randomize_bias(m)
    m.gate.expert_bias[...] = m.gate.expert_bias[...].at[jnp.array([1, 6, 11])].set(-10.0)
    x = jax.random.normal(jax.random.key(14), (2, 24, cfg.base_emb_dim))
    ct = jax.random.normal(jax.random.key(15), x.shape)

    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y.astype(jnp.float32) * ct) + aux.loss, (y, aux.counts)

    def run():  # a new function per run: a fresh trace of the (patched) layer
        return nnx.jit(lambda m, x: nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x))(m, x)

    new = run()
    monkeypatch.setattr(moe_experts, "invert", jnp.argsort)
    old = run()
    counts = np.asarray(new[0][1][1])
    assert (counts[[1, 6, 11]] == 0).all() and (counts > 0).sum() >= 8
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_combine_in_bf16_with_fp32_sum_against_float64():
    """bf16 expert outputs and fp32 router weights (as the layer gives them), against the formula in float64
    from the same inputs. Forward: the sum is fp32 (error <= K * 2^-24 * sum_k |w_k y_k|) then rounded once to
    bf16 (<= 2^-8 |out|, half an ulp of an 8-bit significand). Backward: dy = ct * w, one product rounded
    to bf16 (<= 2^-8); dw = sum_d ct * y in fp32 (bf16 products are exact in fp32, so only the sum's
    rounding, <= D * 2^-24 * sum_d |ct y|) and kept in fp32, the weights' dtype. The fp32 formula on fp32
    inputs is reproduced bit for bit."""
    T, K, D = 64, 8, 256
    ks = jax.random.split(jax.random.key(16), 3)
    y_TKD = (jax.random.normal(ks[0], (T, K, D)) * 3).astype(jnp.bfloat16)
    w_TK = jax.random.uniform(ks[1], (T, K), minval=0.01, maxval=2.5)
    ct_TD = jax.random.normal(ks[2], (T, D)).astype(jnp.bfloat16)
    combine = jax.jit(lambda y, w: moe_experts.combine(y, w, jnp.bfloat16))
    out_TD, vjp = jax.vjp(combine, y_TKD, w_TK)
    dy_TKD, dw_TK = vjp(ct_TD)
    assert out_TD.dtype == dy_TKD.dtype == jnp.bfloat16 and dw_TK.dtype == jnp.float32

    y, w, ct = (np.asarray(a, np.float64) for a in (y_TKD, w_TK, ct_TD))
    terms_TKD = w[..., None] * y
    ref_TD = terms_TKD.sum(1)
    err = np.abs(np.asarray(out_TD, np.float64) - ref_TD)
    assert (err <= 2.0 ** -8 * np.abs(ref_TD) + K * 2.0 ** -24 * np.abs(terms_TKD).sum(1)).all(), err.max()
    ref_dy = ct[:, None, :] * w[..., None]
    assert (np.abs(np.asarray(dy_TKD, np.float64) - ref_dy) <= (2.0 ** -8 + 2.0 ** -23) * np.abs(ref_dy)).all()
    prods_TKD = ct[:, None, :] * y
    err_dw = np.abs(np.asarray(dw_TK, np.float64) - prods_TKD.sum(2))
    assert (err_dw <= D * 2.0 ** -24 * np.abs(prods_TKD).sum(2)).all(), err_dw.max()

    y32 = y_TKD.astype(jnp.float32)
    np.testing.assert_array_equal(jax.jit(lambda y, w: moe_experts.combine(y, w, jnp.float32))(y32, w_TK),
                                  jax.jit(lambda y, w: jnp.einsum("tkd,tk->td", y, w))(y32, w_TK))


def test_dropless_keeps_expert_outputs_in_bf16_for_the_backward():
    """What the backward keeps of a bf16 layer holds the unsorted expert outputs [T, K, D] in bf16 (a fp32
    copy would double the largest activation the MoE keeps)."""
    T, K, E, D, F = 32, 4, 8, 64, 16
    bf = jnp.bfloat16
    w = tuple(jax.ShapeDtypeStruct(s, bf) for s in [(E, D, F), (E, D, F), (E, F, D)])
    experts_TK = routing(jax.random.key(0), T, K, E, E)
    ffn = partial(moe_gmm.grouped_ffn, gemm="ragged_dot")
    f = lambda x, weights_TK, *w: moe_experts.dropless(x, experts_TK, weights_TK, w, ffn)
    saved = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], jax.ShapeDtypeStruct((T, D), bf),
                                           jax.ShapeDtypeStruct((T, K), jnp.float32), *w))
    assert ((T, K, D), bf) in [(r.shape, r.dtype) for r in saved]
    assert not [r for r in saved if r.dtype == jnp.float32 and r.size >= T * D], [(r.shape, r.dtype) for r in saved]
