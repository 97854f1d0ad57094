"""Logical-axis rules -> PartitionSpecs and meshes, on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ling2.config import load_config
from ling2.layers import sharding

RULES = [("activation_batch", ["data", "fsdp", "expert"]), ("embed", ["fsdp"]), ("heads", ["tensor"]),
         ("exp", ["expert"]), ("mlp", ["tensor"]), ("kv", None), ("layers", None)]


def mesh(**sizes):
    cfg = load_config(**{f"ici_{a}_parallelism": sizes.get(a, 1) for a in sharding.MESH_AXES})
    return sharding.make_mesh(cfg)


def test_mesh_shape_fill_and_errors():
    cfg = load_config(ici_fsdp_parallelism=-1, ici_expert_parallelism=2, ici_tensor_parallelism=2)
    assert sharding.mesh_shape(cfg, 8) == (1, 2, 2, 2)
    assert dict(sharding.make_mesh(cfg).shape) == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    with pytest.raises(ValueError, match="ici_"):
        sharding.mesh_shape(load_config(ici_fsdp_parallelism=3), 8)
    with pytest.raises(ValueError, match="ici_"):
        sharding.mesh_shape(load_config(ici_fsdp_parallelism=-1, ici_tensor_parallelism=3), 8)


def test_logical_to_spec():
    m = mesh(fsdp=2, expert=2, tensor=2)
    rules = sharding.rules_dict(RULES)
    spec = lambda names, shape: sharding.logical_to_spec(names, shape, rules, m)
    assert spec(("exp", "embed", "mlp"), (4, 8, 6)) == P("expert", "fsdp", "tensor")
    assert spec(("activation_batch", None, "embed"), (8, 3, 8)) == P(("fsdp", "expert"), None, None)  # fsdp used
    assert spec(("activation_batch", None), (2, 3)) == P("fsdp", None)  # 2 rows: only one axis of size 2 divides
    assert spec(("heads", "kv"), (3, 4)) == P(None, None)  # 3 heads do not divide by tensor=2
    assert spec(("layers", "embed", "heads", "kv"), (2, 8, 4, 4)) == P(None, "fsdp", "tensor", None)
    with pytest.raises(ValueError, match="no rule"):
        spec(("nope",), (4,))
    with pytest.raises(ValueError, match="do not match"):
        spec(("embed",), (4, 4))


def test_constrain_is_identity_outside_and_shards_inside():
    x = jnp.arange(64.0).reshape(8, 8)
    assert sharding.constrain(x, ("activation_batch", "embed")) is x
    m = mesh(fsdp=2, expert=2, tensor=2)
    with sharding.use_mesh(m, RULES):
        y = jax.jit(lambda x: sharding.constrain(x * 2, ("activation_batch", "mlp")))(x)
    assert y.sharding.spec == P(("fsdp", "expert"), "tensor")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_state_shardings_follow_param_names():
    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 8, 6)), out_sharding=("exp", "embed", "mlp"), eager_sharding=False)
            self.b = nnx.Param(jnp.ones((6,)))

    m = mesh(fsdp=2, expert=2, tensor=2)
    sh = sharding.state_shardings(nnx.state(M()), m, RULES)
    assert sh["w"].spec == P("expert", "fsdp", "tensor")
    assert sh["b"].spec == P()


def test_create_sharded_matches_plain_init():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 8, 6)), out_sharding=("exp", "embed", "mlp"),
                               eager_sharding=False)
            self.b = nnx.Param(jnp.zeros((6,)), out_sharding=("mlp",), eager_sharding=False)

    m = mesh(fsdp=2, expert=2, tensor=2)
    sharded = sharding.create_sharded(lambda: M(nnx.Rngs(0)), m, RULES)
    assert sharded.w[...].sharding.spec == P("expert", "fsdp", "tensor")
    assert sharded.b[...].sharding.spec == P("tensor")
    np.testing.assert_array_equal(np.asarray(sharded.w[...]), np.asarray(M(nnx.Rngs(0)).w[...]))
