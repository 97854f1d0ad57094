"""The decoder sharded on 8 fake CPU devices (fsdp 2 x expert 2 x tensor 2) equals one device:
loss, logits, MoE counts and gradients. Covers dense + MoE, GLA + MLA and scanned params."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config import load_config
from ling2.layers import decoder
from ling2.layers.spec import ModelSpec
from ling2.train import runtime

# 4 layers, groups of 2 (GLA + MLA): layer 0 dense -> prefix [0, 2) unscanned, one scanned group [2, 4).
CFG = dict(model_name="ling2-tiny", vocab_size=64, base_emb_dim=32, base_mlp_dim=48, base_num_query_heads=2,
           base_num_kv_heads=2, head_dim=16, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=8, num_experts=8, num_experts_per_tok=2, n_routing_groups=2, topk_routing_group=1,
           base_moe_mlp_dim=16, moe_shared_expert_dim=16, base_num_decoder_layers=4, scan_layers=True,
           inhomogeneous_layer_cycle_interval=2, gla_chunk_size=8, dtype="float32", init_std=0.1,
           ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_tensor_parallelism=2)


def loss_fn(m, ids_BT, pos, seg):
    out = m(ids_BT, pos, seg)
    return jnp.mean(out.logits ** 2) + sum(a.loss for a in out.moe_aux.values()), out


def test_sharded_equals_single_device():
    assert jax.device_count() == 8
    cfg = load_config(**CFG)
    model = decoder.Ling2Decoder(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (4, 16)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 6 + [2] * 10], 4, 0))
    pos = jnp.asarray(np.repeat([list(range(6)) + list(range(10))], 4, 0))
    step = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))
    (loss1, out1), g1 = step(model, ids, pos, seg)

    mesh = runtime.make_mesh(cfg)
    _, state = nnx.split(model)
    gdef, _ = nnx.split(nnx.eval_shape(lambda: decoder.Ling2Decoder(ModelSpec.of(cfg, mesh), rngs=nnx.Rngs(0))))
    state = jax.device_put(state, runtime.state_shardings(state, mesh, cfg.logical_axis_rules))
    specs = {"/".join(map(str, k)): v[...].sharding.spec for k, v in nnx.to_flat_state(state)}
    P = jax.sharding.PartitionSpec
    assert specs["groups/layers/0/mlp/experts/gate_proj"] == P(None, "expert", "fsdp", "tensor")
    assert specs["prefix/0/attention/qkv"] == P("fsdp", None, "tensor", None)
    assert specs["embed/embedding"] == P("tensor", "fsdp")
    with jax.set_mesh(mesh):
        (loss8, out8), g8 = step(nnx.merge(gdef, state), ids, pos, seg)

    np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out8.logits), np.asarray(out1.logits), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out8.hidden), np.asarray(out1.hidden), rtol=1e-4, atol=1e-5)
    assert sorted(out8.moe_aux) == [1, 2, 3]
    for i in out1.moe_aux:
        np.testing.assert_array_equal(out8.moe_aux[i].counts, out1.moe_aux[i].counts)
    flat8 = dict(nnx.to_flat_state(g8))
    for k, v in nnx.to_flat_state(g1):
        ref = np.asarray(v[...])
        np.testing.assert_allclose(np.asarray(flat8[k][...]), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=str(k))
