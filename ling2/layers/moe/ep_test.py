"""Expert parallelism on 8 fake CPU devices (expert=4 x data=2, and expert=4 x fsdp=2): forward and gradients equal the
single-device dropless result (the reference here is the same layer with no mesh, itself checked
against a float64 numpy loop in moe_test.py), with the padded exchange and the ragged one (`emulated`:
XLA:CPU cannot run ragged all-to-all; the real op is compiled for TPU in tests/moe_ep_tpu_compile_test.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from ling2.config import load_config
from ling2.layers.moe import ep as moe_ep
from ling2.layers.moe import plan as moe_plan
from ling2.layers.moe.layer import MoE
from ling2.config.specs import MoESpec


def make_mesh(data, expert, fsdp=1, tensor=1):
    devices = np.asarray(jax.devices()[: data * fsdp * expert * tensor]).reshape(data, fsdp, expert, tensor)
    return Mesh(devices, ("data", "fsdp", "expert", "tensor"), axis_types=(AxisType.Auto,) * 4)


def loss_and_grads(m, x, ct):
    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y * ct) + aux.loss, (y, aux.counts)

    (l, (y, counts)), (gm, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)
    return y, counts, gm, gx


def moe_case(cfg, gmm, tokens, skew=0.0):
    """The layer (expert bias random, the first two experts' raised by `skew`), 8 x `tokens` inputs, a
    cotangent, and the jitted step: the one-device run and the mesh run share them."""
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0), gmm=gmm)
    bias = jax.random.normal(jax.random.key(3), (cfg.num_experts,)) * 0.05
    m.gate.expert_bias[...] = bias.at[:2].add(skew)
    x = jax.random.normal(jax.random.key(1), (8, tokens, cfg.base_emb_dim))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    return m, x, ct, nnx.jit(loss_and_grads)


def for_mesh(m, cfg, mesh):
    """The layer `m` built for `mesh` (its spec's run carries the mesh), with m's weights and expert bias."""
    on_mesh = MoE(MoESpec.of(cfg, mesh), rngs=nnx.Rngs(0), gmm=m.gmm)
    nnx.update(on_mesh, nnx.state(m))
    return on_mesh


def assert_same(one, mesh_run, nonzero_grads=False):
    """Outputs, expert counts and every gradient of a mesh step equal the one-device step's."""
    (y1, c1, gm1, gx1), (y8, c8, gm8, gx8) = one, mesh_run
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(c8, c1)
    np.testing.assert_allclose(gx8, gx1, rtol=1e-4, atol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(gm8), nnx.to_flat_state(gm1)):
        if nonzero_grads:
            assert np.abs(np.asarray(b[...])).max() > 0 or "bias" in str(path), path
        np.testing.assert_allclose(a[...], b[...], rtol=1e-4, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("gmm,data,expert,fsdp", [("tiled", 2, 4, 1), ("ragged_dot", 2, 4, 1), ("megablox", 2, 4, 1),
                                                  ("tiled", 1, 4, 2), ("megablox", 2, 1, 4), ("tiled", 2, 1, 4)])
def test_ep_forward_and_grads_equal_single_device(gmm, data, expert, fsdp, monkeypatch):
    """expert=1: the same shard_map body as the per-device grouped matmul of a multi-device mesh."""
    assert jax.device_count() == 8
    cfg = load_config(model_name="ling2-tiny", load_balance_loss_weight=0.01, moe_z_loss_weight=0.001,
                      base_moe_mlp_dim=128)  # megablox's tiles: multiples of 128
    m, x, ct, step = moe_case(cfg, gmm, 4)
    one = step(m, x, ct)
    traced = []
    real = moe_ep.dropless_ep
    monkeypatch.setattr(moe_ep, "dropless_ep", lambda *a, **k: traced.append(1) or real(*a, **k))
    mesh = make_mesh(data=data, expert=expert, fsdp=fsdp)
    with jax.set_mesh(mesh):
        mesh_run = step(for_mesh(m, cfg, mesh), x, ct)
    assert traced  # the mesh step retraced and took the shard_map path
    assert_same(one, mesh_run, nonzero_grads=True)


def test_tensor_parallel_experts_without_expert_axis_are_partitioned_by_xla(monkeypatch):
    """No shard_map (XLA splits the experts' width over `tensor`); equal to one device; an explicit
    megablox, which XLA cannot partition, is refused by name."""
    cfg = load_config(model_name="ling2-tiny", base_moe_mlp_dim=128)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 4, cfg.base_emb_dim))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    step = nnx.jit(loss_and_grads)
    y1, _, gm1, gx1 = step(m, x, ct)
    monkeypatch.setattr(moe_ep, "dropless_ep", lambda *a, **k: pytest.fail("took the shard_map path"))
    mesh = make_mesh(data=4, expert=1, tensor=2)
    with jax.set_mesh(mesh):
        y8, _, gm8, gx8 = step(for_mesh(m, cfg, mesh), x, ct)
        with pytest.raises(ValueError, match="megablox: a tensor-parallel mesh"):
            step(MoE(MoESpec.of(cfg, mesh), rngs=nnx.Rngs(0), gmm="megablox"), x, ct)
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx8, gx1, rtol=1e-4, atol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(gm8), nnx.to_flat_state(gm1)):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-4, atol=1e-6, err_msg=str(path))


def test_ep_needs_batch_sharded_over_expert_and_divisible_experts():
    cfg = load_config(model_name="ling2-tiny")
    x = jnp.zeros((2, 4, cfg.base_emb_dim))  # batch 2 cannot be split over expert=4
    mesh = make_mesh(data=2, expert=4)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="expert"):
            MoE(MoESpec.of(cfg, mesh), rngs=nnx.Rngs(0))(x)
    w = (jnp.zeros((6, 128, 8)),) * 2 + (jnp.zeros((6, 8, 128)),)
    with pytest.raises(ValueError, match="not divisible"):
        moe_ep.dropless_ep(jnp.zeros((8, 2, 128)), jnp.zeros((8, 2, 2), jnp.int32), jnp.zeros((8, 2, 2)), w,
                           mesh=make_mesh(2, 4), rules=cfg.logical_axis_rules,
                           plans=moe_plan.plans(MoESpec.of(cfg), {"data": 2, "expert": 4}, tokens=16, model_dim=128,
                                                gmm="tiled"))


@pytest.mark.parametrize("expert,capacity,skew", [(2, 0.0, 0.0), (4, 0.0, 0.0), (8, 0.0, 0.0), (4, 2.5, 0.0),
                                                  (4, 1.0, 3.0)])
def test_ragged_ep_layer_equals_single_device(expert, capacity, skew, monkeypatch):
    """The ragged exchange (moe_ep_all_to_all=emulated). Receive bound: capacity 0, room for every row; 2.5
    (this routing sends one shard 2.4x its share), 0.6 of every row; 1.0 with a bias that sends most tokens
    to two experts: some shard is sent more rows than the bound, the exchange runs in rounds, and no token is
    dropped."""
    assert jax.device_count() == 8
    cfg = load_config(model_name="ling2-tiny", load_balance_loss_weight=0.01, moe_z_loss_weight=0.001,
                      moe_ep_all_to_all="emulated", moe_ep_capacity_factor=capacity)
    m, x, ct, step = moe_case(cfg, "tiled", 16, skew)
    one = step(m, x, ct)
    kinds = []
    real = moe_ep._local_ragged
    monkeypatch.setattr(moe_ep, "_local_ragged", lambda *a, **k: kinds.append(k["emulated"]) or real(*a, **k))
    mesh = make_mesh(data=8 // expert, expert=expert)
    with jax.set_mesh(mesh):
        mesh_run = step(for_mesh(m, cfg, mesh), x, ct)
    assert kinds == [True]  # the ragged body ran (emulated), once per trace
    # rows each expert shard receives against the bound: over it with the skew (most rows to the first
    # shard), within it otherwise (the ragged exchange itself ran)
    per_shard = np.asarray(one[1]).reshape(expert, -1).sum(1)
    bound = moe_ep.recv_rows(8 * 16 * cfg.num_experts_per_tok // expert, expert, capacity)
    assert (per_shard.max() > bound) == bool(skew), (per_shard, bound)
    assert_same(one, mesh_run)


@pytest.mark.parametrize("a2a,capacity,skew", [("padded", 0.0, 0.0), ("emulated", 1.0, 3.0)])
def test_ep_layer_unchanged_by_single_sort(a2a, capacity, skew, monkeypatch):
    """Output, counts and every gradient bit for bit against the same step with each inverse permutation
    taken by a second argsort: the padded exchange, and the ragged one run in rounds (skewed routing)."""
    cfg = load_config(model_name="ling2-tiny", load_balance_loss_weight=0.01, moe_z_loss_weight=0.001,
                      moe_ep_all_to_all=a2a, moe_ep_capacity_factor=capacity)
    m, x, ct, _ = moe_case(cfg, "tiled", 16, skew)
    mesh = make_mesh(data=2, expert=4)
    m = for_mesh(m, cfg, mesh)
    run = lambda: nnx.jit(lambda m, x, ct: loss_and_grads(m, x, ct))(m, x, ct)  # a fresh trace per run
    with jax.set_mesh(mesh):
        new = run()
        monkeypatch.setattr(moe_ep.X, "invert", jnp.argsort)
        old = run()
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        np.testing.assert_array_equal(a, b)
