"""Logical-axis rules -> PartitionSpecs and activation constraints, on 8 fake CPU devices."""

import types

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


def run_on(m):
    """The sharding part of a RunSpec: the mesh's axis sizes and RULES."""
    return types.SimpleNamespace(mesh_shape=tuple(m.shape.items()) if m else (),
                                 logical_axis_rules=tuple((n, tuple(a or ())) for n, a in RULES))


def test_constrain_is_identity_on_one_device_and_shards_on_the_runs_mesh():
    x = jnp.arange(64.0).reshape(8, 8)
    assert sharding.constrain(x, ("activation_batch", "embed"), run_on(None)) is x
    m = mesh(fsdp=2, expert=2, tensor=2)
    with jax.set_mesh(m):
        y = jax.jit(lambda x: sharding.constrain(x * 2, ("activation_batch", "mlp"), run_on(m)))(x)
    assert y.sharding.spec == P(("fsdp", "expert"), "tensor")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)


def test_a_layer_built_for_one_mesh_refuses_another():
    """The mesh reaches a layer in its spec; calling it under another ambient mesh, or none, is an error."""
    x = jnp.arange(64.0).reshape(8, 8)
    m = mesh(fsdp=2, expert=2, tensor=2)
    with pytest.raises(ValueError, match="runs under no mesh"):
        sharding.constrain(x, ("activation_batch", "mlp"), run_on(m))
    with jax.set_mesh(mesh(data=8)), pytest.raises(ValueError, match="built for the mesh"):
        sharding.constrain(x, ("activation_batch", "mlp"), run_on(m))


def test_dim_and_context_axes_come_from_the_run():
    run = run_on(mesh(data=2, tensor=4))
    assert sharding.dim_axes(run, "mlp", 8) == ("tensor",) and sharding.dim_shards(run, "mlp", 8) == 4
    assert sharding.dim_shards(run, "mlp", 6) == 1  # 4 does not divide 6: whole
    assert sharding.dim_shards(run_on(None), "mlp", 8) == 1
    cp = types.SimpleNamespace(mesh_shape=(("data", 2), ("context", 4)),
                               logical_axis_rules=(("activation_length", ("context",)),))
    assert sharding.context_axes(cp, 16, "test") == "context"
    assert sharding.context_axes(run_on(None), 16, "test") is None
    with pytest.raises(ValueError, match="test: the sequence of 6 positions does not split"):
        sharding.context_axes(cp, 6, "test")


def test_shard_map_by_names_splits_each_name_one_way_and_matches_one_device():
    """Per-device shapes seen inside, and the result against the same function on whole arrays."""
    m = mesh(data=2, tensor=4)
    seen = []

    def f(x_BTH, g_H, w):
        seen.append((x_BTH.shape, g_H.shape, w.shape))
        return x_BTH * g_H + w.sum(), jnp.sum(x_BTH, axis=1)

    r = np.random.default_rng(0)
    x, g, w = (jnp.asarray(r.normal(size=s), jnp.float32) for s in [(4, 3, 8), (8,), (2, 5)])
    names = (("activation_batch", None, "heads"), ("heads",), P())
    out_names = (("activation_batch", None, "heads"), ("activation_batch", "heads"))
    with jax.set_mesh(m):
        got = jax.jit(sharding.shard_map_by_names(f, names, out_names, RULES))(x, g, w)
    assert seen[-1] == ((2, 3, 2), (2,), (2, 5))  # batch over data (2), heads over tensor (4), w whole
    for a, b in zip(got, f(x, g, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert sharding.shard_map_by_names(f, names, out_names, RULES)(x, g, w)[1].shape == (4, 8)  # no mesh: f itself
    with jax.set_mesh(m), pytest.raises(ValueError, match="'heads' splits as tensor on one argument and None"):
        sharding.shard_map_by_names(f, names, out_names, RULES)(x, jnp.ones((3,)), w)
