"""Logical-axis rules -> PartitionSpecs and activation constraints, on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ling2.layers import sharding

RULES = [("activation_batch", ["data", "fsdp", "expert"]), ("embed", ["fsdp"]), ("heads", ["tensor"]),
         ("exp", ["expert"]), ("mlp", ["tensor"]), ("kv", None), ("layers", None)]


def mesh(**sizes):
    axes = ("data", "fsdp", "expert", "tensor")
    return jax.make_mesh(tuple(sizes.get(a, 1) for a in axes), axes,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


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
