"""The trainer runtime: mesh shapes from the config, parameter shardings from logical names (8 fake CPU devices)."""

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
    assert runtime.mesh_shape(cfg, 8) == (1, 2, 2, 2)
    assert dict(runtime.make_mesh(cfg).shape) == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    with pytest.raises(ValueError, match="ici_"):
        runtime.mesh_shape(load_config(ici_fsdp_parallelism=3), 8)
    with pytest.raises(ValueError, match="ici_"):
        runtime.mesh_shape(load_config(ici_fsdp_parallelism=-1, ici_tensor_parallelism=3), 8)


def test_state_shardings_follow_param_names():
    class M(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 8, 6)), out_sharding=("exp", "embed", "mlp"), eager_sharding=False)
            self.b = nnx.Param(jnp.ones((6,)))

    m = mesh(fsdp=2, expert=2, tensor=2)
    sh = runtime.state_shardings(nnx.state(M()), m, RULES)
    assert sh["w"].spec == P("expert", "fsdp", "tensor")
    assert sh["b"].spec == P()
