"""The trainer runtime: mesh shapes from the config, parameter shardings from logical names (8 fake CPU devices)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ling2.config import load_config
from ling2.train import runtime

RULES = [("activation_batch", ["data", "fsdp", "expert"]), ("embed", ["fsdp"]), ("heads", ["tensor"]),
         ("exp", ["expert"]), ("mlp", ["tensor"]), ("kv", None), ("layers", None)]


def mesh(**sizes):
    cfg = load_config(**{f"ici_{a}_parallelism": sizes.get(a, 1) for a in runtime.MESH_AXES})
    return runtime.make_mesh(cfg)


def test_mesh_shape_fill_and_errors():
    cfg = load_config(ici_fsdp_parallelism=-1, ici_expert_parallelism=2, ici_tensor_parallelism=2)
    assert runtime.mesh_shape(cfg, 8) == (1, 1, 2, 2, 1, 2)
    assert dict(runtime.make_mesh(cfg).shape) == {"stage": 1, "data": 1, "fsdp": 2, "expert": 2, "context": 1,
                                                  "tensor": 2}
    with pytest.raises(ValueError, match="ici_"):
        runtime.mesh_shape(load_config(ici_fsdp_parallelism=3), 8)
    with pytest.raises(ValueError, match="ici_"):
        runtime.mesh_shape(load_config(ici_fsdp_parallelism=-1, ici_tensor_parallelism=3), 8)


def test_multi_slice_mesh_shapes_and_errors():
    cfg = load_config(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2, dcn_data_parallelism=2, dcn_fsdp_parallelism=-1)
    assert runtime.mesh_shapes(cfg, 32, num_slices=4) == ((1, 1, 4, 1, 1, 2), (1, 2, 2, 1, 1, 1))
    assert runtime.mesh_shape(cfg, 32, num_slices=4) == (1, 2, 8, 1, 1, 2)
    with pytest.raises(ValueError, match="dcn_"):  # 2 x 2 slices asked for, 2 there
        runtime.mesh_shape(load_config(dcn_data_parallelism=2, dcn_expert_parallelism=2), 16, num_slices=2)
    with pytest.raises(ValueError, match="dcn_"):  # one slice cannot be split over dcn
        runtime.mesh_shape(load_config(dcn_data_parallelism=2), 8)
    with pytest.raises(ValueError, match="slices"):
        runtime.mesh_shape(load_config(), 10, num_slices=4)


def test_hybrid_device_array_puts_slices_outermost():
    """Hand-built case: 2 slices of 4 devices (slice s holds 10s..10s+3), ici (fsdp 2, tensor 2),
    dcn over data and fsdp would need 4 slices, so dcn (data 2): the data axis is the slice index."""
    slices = [[0, 1, 2, 3], [10, 11, 12, 13]]
    arr = runtime.hybrid_device_array(slices, (1, 2, 1, 2), (2, 1, 1, 1))
    assert arr.shape == (2, 2, 1, 2)
    assert arr[0].ravel().tolist() == [0, 1, 2, 3] and arr[1].ravel().tolist() == [10, 11, 12, 13]
    # dcn along fsdp: fsdp index = slice * ici_fsdp + ici index, so fsdp rows 0-1 are slice 0, 2-3 slice 1.
    arr = runtime.hybrid_device_array(slices, (1, 2, 1, 2), (1, 2, 1, 1))
    assert arr.shape == (1, 4, 1, 2)
    assert arr[0, :, 0, :].tolist() == [[0, 1], [2, 3], [10, 11], [12, 13]]


def test_state_shardings_follow_param_names():
    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 8, 6)), out_sharding=("exp", "embed", "mlp"), eager_sharding=False)
            self.b = nnx.Param(jnp.ones((6,)))

    m = mesh(fsdp=2, expert=2, tensor=2)
    sh = runtime.state_shardings(nnx.state(M()), m, RULES)
    assert sh["w"].spec == P("expert", "fsdp", "tensor")
    assert sh["b"].spec == P()


def test_optimizer_state_is_sharded_like_its_parameters():
    """Adam's moments take their parameter's sharding (abstract and real state), counters are replicated;
    per device the moments are 2x the parameters' bytes, not 2x the whole model."""
    from ling2.train.state import abstract_state, init_state

    cfg = load_config(model_name="ling2-micro", ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_tensor_parallelism=2)
    m = runtime.make_mesh(cfg)
    setup = abstract_state(cfg, m)
    abstract, real = setup.state, init_state(cfg, m, setup)
    param_specs = [x.sharding.spec for x in jax.tree.leaves(abstract.params)]
    assert any(s != P() for s in param_specs)
    for tree in (abstract.opt_state, real.opt_state):
        adam = tree[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
        for moments in (adam.mu, adam.nu):
            assert [x.sharding.spec for x in jax.tree.leaves(moments)] == param_specs
        assert adam.count.sharding.spec == P() and adam.count.sharding.mesh.size == 8
    shard = lambda t: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(t))
    assert shard(real.opt_state) < 2.1 * shard(real.params)


def test_context_axis_splits_batch_positions_and_is_checked_once_filled():
    """The context axis (-1: fills the 8 devices) must split sequences into whole kernel chunks: 32 positions
    in chunks of 8 do not split 8 ways; 64 do, and the batch's positions are then split 8 ways."""
    kw = dict(model_name="ling2-micro", gla_chunk_size=8, ici_fsdp_parallelism=1, ici_context_parallelism=-1)
    with pytest.raises(ValueError, match=r"ici_context_parallelism: context parallelism 8 needs max_target_length"):
        runtime.make_mesh(load_config(max_target_length=32, **kw))
    cfg = load_config(max_target_length=64, **kw)
    m = runtime.make_mesh(cfg)
    assert m.shape["context"] == 8
    assert runtime.batch_sharding(cfg, m, 2, 64).spec == P(None, None, "context")


def test_data_share_of_a_process_from_the_blocks_its_devices_hold():
    """Hand-made layouts of a [4, 64] micro-batch: whole rows per process (Megatron's data-parallel slices), a
    context group spanning processes (every process the same rows, its own positions), and pieces that are no
    block of whole row groups (a named error)."""
    assert runtime.share_of({(2, 4, 0, 64)}, 4, 64) == runtime.DataShare(1, 2, 0, 64)
    assert runtime.share_of({(0, 2, 0, 32), (0, 2, 32, 64)}, 4, 64) == runtime.DataShare(0, 2, 0, 64)
    quarter = {(0, 4, p, p + 8) for p in range(32, 64, 8)}  # 4 devices, each 8 positions of every row
    assert runtime.share_of(quarter, 4, 64) == runtime.DataShare(0, 1, 32, 64)
    with pytest.raises(ValueError, match="not one block of whole row groups"):
        runtime.share_of({(0, 2, 0, 32), (2, 4, 32, 64)}, 4, 64)
    with pytest.raises(ValueError, match="not one block"):
        runtime.share_of({(1, 3, 0, 64)}, 4, 64)


def test_ragged_exchange_on_cpu_is_a_named_error():
    """XLA:CPU cannot run ragged all-to-all: asking for it by name with an expert axis is refused before the
    model is built; auto, padded and emulated are accepted, and so is ragged without an expert axis."""
    kw = dict(ici_fsdp_parallelism=1, ici_data_parallelism=-1)
    with pytest.raises(ValueError, match="moe_ep_all_to_all: 'ragged' cannot run on CPU"):
        runtime.make_mesh(load_config(moe_ep_all_to_all="ragged", ici_expert_parallelism=4, **kw))
    for a2a in ("auto", "padded", "emulated"):
        assert runtime.make_mesh(load_config(moe_ep_all_to_all=a2a, ici_expert_parallelism=4, **kw)).shape["expert"] == 4
    assert runtime.make_mesh(load_config(moe_ep_all_to_all="ragged", **kw)).shape["expert"] == 1


def test_rows_per_micro_batch_must_be_whole():
    """per_device_batch_size x devices is the micro-batch's sequences: a fraction would be rounded away silently."""
    devices = jax.devices()[:8]
    with pytest.raises(ValueError, match=r"per_device_batch_size: 0.3 x 8 device\(s\) = 2.4 sequences per "
                                         r"micro-batch, not a whole number"):
        runtime.make_mesh(load_config(per_device_batch_size=0.3), devices)
    assert runtime.make_mesh(load_config(per_device_batch_size=0.25), devices).size == 8


def test_routed_rows_per_micro_batch_fit_int32():
    """JAX indexes arrays with int32: a micro-batch whose tokens x top-k reach 2^31 is a named error, not an
    OverflowError traceback while tracing. ling2-tiny: 256 tokens, top-4, on 8 devices (by hand: 2^31 / (8 x 256
    x 4) = 262,144 sequences per device is the first refused)."""
    devices = jax.devices()[:8]
    cfg = load_config(model_name="ling2-tiny")
    assert (cfg.max_target_length, cfg.num_experts_per_tok) == (256, 4)
    assert runtime.make_mesh(load_config(model_name="ling2-tiny", per_device_batch_size=262_143), devices).size == 8
    with pytest.raises(ValueError, match=r"per_device_batch_size: 2,097,152 sequences x 256 tokens x 4 experts each = "
                                         r"2,147,483,648 rows per micro-batch, past what JAX indexes"):
        runtime.make_mesh(load_config(model_name="ling2-tiny", per_device_batch_size=262_144), devices)
