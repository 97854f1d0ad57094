"""Train-step semantics on a micro Ling2 (2 layers: GLA + MLA, dense then MoE).

References: gradient accumulation is checked against the same step on the whole batch
(per-token mode) and against a hand computation from per-micro-batch losses (the other
mode); the bias update against `update_routed_bias` applied by hand.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers import losses
from ling2.layers.moe.router import update_routed_bias
from ling2.train import step as S
from ling2.layers.model import Ling2Model
from ling2.train.state import TrainState, trainable_filter
from ling2.train.optim import make_optimizer
from ling2.layers.spec import ModelSpec

MICRO = dict(model_name="ling2-micro", mtp_num_layers=0, vocab_size=128, max_target_length=16, warmup_steps_fraction=0.0,
             lr_schedule="constant", gradient_clipping_threshold=0.0, adam_weight_decay=0.0)


def make(**kw):
    cfg = load_config(**{**MICRO, **kw})
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    gd, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    tx, sched = make_optimizer(cfg, params)
    z = lambda: jnp.zeros((), jnp.int32)
    state = TrainState(step=z(), params=params, rest=rest, opt_state=tx.init(params), skipped=z(), skipped_total=z())
    fn = jax.jit(functools.partial(S.train_step, gd, tx, cfg, lr_fn=sched))
    return cfg, gd, state, fn


def batch(M, b, T=16, seed=0, vocab=128, uneven=False):
    r = np.random.default_rng(seed)
    ids = r.integers(0, vocab, (M, b, T + 1))
    w = np.ones((M, b, T), np.float32)
    if uneven:  # different token counts per micro-batch
        for m in range(M):
            w[m, :, T - 3 * m:] = 0
    return dict(inputs=jnp.asarray(ids[..., :-1]), targets=jnp.asarray(ids[..., 1:]),
                positions=jnp.broadcast_to(jnp.arange(T), (M, b, T)), segment_ids=jnp.ones((M, b, T), jnp.int32),
                loss_weights=jnp.asarray(w))


def reshape(b, M):
    return jax.tree.map(lambda x: x.reshape(M, -1, *x.shape[2:]), b)


def test_grad_accumulation_per_token_equals_full_batch():
    full = batch(1, 8, uneven=False)
    full["loss_weights"] = full["loss_weights"].at[0, :3, 10:].set(0)  # uneven rows
    # With adam_eps >> |g| the first Adam step is ~ lr * g / eps, linear in g (lr=1 keeps it far above float32
    # noise), so the parameter deltas compare the gradients themselves, scale included.
    _, _, s1, f1 = make(gradient_accumulation_steps=1, calculate_per_token_loss=True, adam_eps=10.0,
                        learning_rate=1.0)
    _, _, s4, f4 = make(gradient_accumulation_steps=4, calculate_per_token_loss=True, adam_eps=10.0,
                        learning_rate=1.0)
    n1, m1 = f1(s1, full)
    n4, m4 = f4(s4, reshape(full, 4))
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=2e-4)
    for p0, a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(n1.params), jax.tree.leaves(n4.params)):
        d1, d4 = np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0)
        ulp = 2 * np.spacing(np.abs(np.asarray(p0, np.float32))).max()  # the updated parameter's own rounding
        np.testing.assert_allclose(d4, d1, rtol=2e-3, atol=1e-3 * np.abs(d1).max() + ulp + 1e-12)


def test_grad_accumulation_micro_mean_mode_matches_hand_computation():
    M = 4
    b = batch(M, 2, uneven=True)
    cfg, gd, s, f = make(gradient_accumulation_steps=M, calculate_per_token_loss=False)
    _, m = f(s, b)
    model = nnx.merge(gd, s.params, s.rest)
    means = []
    for i in range(M):
        out = model.decoder(b["inputs"][i], b["positions"][i], b["segment_ids"][i])
        ce, n, _ = losses.cross_entropy_sums(out.logits, b["targets"][i], b["loss_weights"][i])
        means.append(float(ce) / float(n))
    # Each micro-batch averages its own tokens, then micro-batches weigh equally.
    np.testing.assert_allclose(float(m["loss"]), np.mean(means), rtol=1e-5)
    tokens = [float(b["loss_weights"][i].sum()) for i in range(M)]
    assert len(set(tokens)) > 1  # the two modes really differ on this batch
    per_token = sum(mm * t for mm, t in zip(means, tokens)) / sum(tokens)
    assert abs(per_token - np.mean(means)) > 1e-4


def test_overfit_repeated_batch():
    cfg, gd, s, f = make(learning_rate=3e-3)
    b = batch(1, 4, seed=3)
    first = None
    for _ in range(40):
        s, m = f(s, b)
        first = float(m["loss"]) if first is None else first
    assert float(m["loss"]) < 0.5 * first, (first, float(m["loss"]))


def test_bias_updated_once_per_optimizer_step_from_summed_counts():
    M = 2
    cfg, gd, s, f = make(gradient_accumulation_steps=M, routed_bias_update_rate=0.01, routed_bias_zero_mean_update=True)
    b = batch(M, 2, seed=5)
    new, m = f(s, b)
    before = {tuple(idx): np.asarray(v[...]) for v, idx in nnx.merge(gd, s.params, s.rest).expert_biases()}
    after = {tuple(idx): np.asarray(v[...]) for v, idx in nnx.merge(gd, new.params, new.rest).expert_biases()}
    assert before.keys() == after.keys() and before
    for idx, old in before.items():
        counts = np.asarray(m["moe"]["counts"][idx[0]])
        assert counts.sum() == M * 2 * 16 * cfg.num_experts_per_tok  # summed over both micro-batches
        want = update_routed_bias(jnp.asarray(old), jnp.asarray(counts), 0.01, True)
        np.testing.assert_allclose(after[idx], np.asarray(want), atol=1e-7)
        assert not np.allclose(after[idx], old)
    # The bias takes no gradient and is not in the optimizer.
    assert not any("expert_bias" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(s.params))


def test_bias_update_moves_each_row_of_a_scanned_stack_by_its_layer_counts():
    """A scanned group stacks its layers' biases [n, E]: row g is moved by layer g's counts alone."""
    cfg = load_config(**{**MICRO, "model_name": "ling2-tiny", "base_num_decoder_layers": 15, "scan_layers": True,
                         "routed_bias_update_rate": 0.01})
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    gd, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    before = [(np.asarray(v[...]), idx) for v, idx in model.expert_biases()]
    assert any(len(idx) > 1 for _, idx in before)
    r = np.random.default_rng(0)
    counts = {i: jnp.asarray(r.integers(0, 50, cfg.num_experts), jnp.float32) for _, idx in before for i in idx}
    moved = nnx.merge(gd, *(S.update_expert_biases(t, counts, ModelSpec.of(cfg)) for t in (params, rest)))
    for (old, idx), (var, _) in zip(before, moved.expert_biases()):
        rows = old.reshape(len(idx), -1)
        want = np.stack([update_routed_bias(jnp.asarray(rows[g]), counts[i], 0.01, cfg.routed_bias_zero_mean_update)
                         for g, i in enumerate(idx)])
        np.testing.assert_array_equal(np.asarray(var[...]), want.reshape(old.shape))


def test_non_finite_step_is_skipped():
    cfg, gd, s, f = make()
    b = batch(1, 2)
    b["loss_weights"] = b["loss_weights"].at[0, 0, 0].set(jnp.nan)
    new, m = f(s, b)
    assert int(new.skipped) == 1 and int(new.skipped_total) == 1 and float(m["finite"]) == 0
    for a, c in zip(jax.tree.leaves(s.params), jax.tree.leaves(new.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_lr_metric_is_the_rate_applied_after_a_skipped_step():
    """Warmup 0 -> 1 over 10 steps, so lr(n) = n / 10 by hand. The 3rd step is non-finite and applies nothing:
    the 4th applies the 3rd update, at lr(2) again, and the 5th the 4th, at lr(3) (not lr(4))."""
    cfg, gd, s, f = make(lr_schedule="constant", warmup_steps_fraction=0.1, steps=100, learning_rate=1.0)
    good, bad = batch(1, 2), batch(1, 2)
    bad["loss_weights"] = bad["loss_weights"].at[0, 0, 0].set(jnp.nan)
    lrs = []
    for b in (good, good, bad, good, good):
        s, m = f(s, b)
        lrs.append(float(m["lr"]))
    assert int(s.step) == 5 and int(s.skipped_total) == 1
    np.testing.assert_allclose(lrs, [0.0, 0.1, 0.2, 0.2, 0.3], rtol=1e-6)


def test_router_metrics_under_accumulation_equal_full_batch():
    """Counts and stats are sums, so metrics after 4 micro-batches equal one batch of 8 rows."""
    from ling2.train.hooks import moe_metrics
    full = batch(1, 8, seed=7)
    cfg, _, s1, f1 = make(gradient_accumulation_steps=1)
    _, _, s4, f4 = make(gradient_accumulation_steps=4)
    _, m1 = f1(s1, full)
    _, m4 = f4(s4, reshape(full, 4))
    r1 = moe_metrics(jax.device_get(m1["moe"]), cfg.num_experts_per_tok)
    r4 = moe_metrics(jax.device_get(m4["moe"]), cfg.num_experts_per_tok)
    assert r1.keys() == r4.keys() and len(r1) > 1
    for layer in r1:
        if isinstance(r1[layer], dict):
            for k in r1[layer]:
                np.testing.assert_allclose(float(r4[layer][k]), float(r1[layer][k]), rtol=1e-4, atol=1e-6,
                                           err_msg=f"{layer}/{k}")


@pytest.mark.parametrize("per_token", [True, False])
def test_mtp_loss_under_accumulation_follows_main_loss_rule(per_token):
    """With MTP on, GA=4 reproduces the full batch (per-token mode) or the mean of micro means."""
    M = 4
    full = batch(1, 8, seed=11)
    full["segment_ids"] = full["segment_ids"].at[0, :, 9:].set(2)  # two documents per row
    kw = dict(mtp_num_layers=1, calculate_per_token_loss=per_token)
    cfg, gd, s1, f1 = make(gradient_accumulation_steps=1, **kw)
    _, _, s4, f4 = make(gradient_accumulation_steps=M, **kw)
    _, m1 = f1(s1, full)
    _, m4 = f4(s4, reshape(full, M))
    if per_token:
        np.testing.assert_allclose(float(m4["mtp_loss"]["depth_1"]), float(m1["mtp_loss"]["depth_1"]), rtol=1e-5)
        np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=2e-4)
    else:
        from ling2.layers.mtp import mtp_loss
        model = nnx.merge(gd, s4.params, s4.rest)
        micro = reshape(full, M)
        means = []
        for i in range(M):
            mb = jax.tree.map(lambda x: x[i], micro)
            out = model.decoder(mb["inputs"], mb["positions"], mb["segment_ids"])
            mo = model.mtp(model.decoder, out, mb["inputs"], mb["targets"], mb["loss_weights"], mb["positions"],
                           mb["segment_ids"])
            means.append(float(mtp_loss(mo.ce_sum, mo.ce_count, 1.0)))
        np.testing.assert_allclose(float(m4["mtp_loss"]["depth_1"]), np.mean(means), rtol=1e-5)
    assert 0 <= float(m4["mtp_top1_accuracy"]["depth_1"]) <= 1
