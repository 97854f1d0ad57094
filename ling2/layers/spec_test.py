"""The ModelSpec: derived once from a Config, the only thing the model reads; the mesh reaches the layers in it."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ling2.layers
from ling2.config import load_config
from ling2.config.schema import MESH_AXES
from ling2.config.specs import RunSpec
from ling2.layers.model import Ling2Model, abstract_model
from ling2.layers.spec import ModelSpec


def test_one_spec_per_config_shared_by_decoder_and_mtp():
    cfg = load_config(model_name="ling2-micro", gla_backend="chunked", remat_policy="full", loss_vocab_blocks=2)
    spec = ModelSpec.of(cfg)
    assert spec == ModelSpec.of(cfg) and hash(spec) == hash(ModelSpec.of(cfg))
    assert [s.attn for s in spec.plan.mtp] == ["mla"] and len(spec.plan.layers) == cfg.base_num_decoder_layers
    # every module spec carries the run's settings, and nothing else holds them
    module_specs = [spec.embed, spec.layers.weights, spec.layers.moe, *(s for _, s in spec.layers.attention)]
    assert all(s.run == spec.run for s in module_specs)
    assert (spec.run.gla_backend, spec.run.remat_policy, spec.run.loss_vocab_blocks) == ("chunked", "full", 2)
    run_fields = {f.name for f in dataclasses.fields(RunSpec)}
    for s in module_specs:
        assert not run_fields & {f.name for f in dataclasses.fields(s)}, type(s).__name__
    model = nnx.eval_shape(lambda: Ling2Model(spec, rngs=nnx.Rngs(0)))
    assert model.decoder.run is spec.run and model.mtp.remat_policy == "full"
    assert abstract_model(spec) is abstract_model(ModelSpec.of(cfg))  # cached by value


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)


def test_no_layer_module_reads_the_config():
    """Below ModelSpec.of (ling2/layers/spec.py) the layers import only the frozen specs and the kind table from
    ling2.config: never the Config, its loader or its schema."""
    root = pathlib.Path(ling2.layers.__file__).parent
    offenders = {}
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith("_test.py") or path.name == "spec.py":
            continue
        for module, names in _imports(path):
            if module == "ling2.config" and set(names) - {"specs", "kinds"}:
                offenders[str(path.relative_to(root))] = names
            elif module.startswith("ling2.config.") and module not in ("ling2.config.specs", "ling2.config.kinds"):
                offenders[str(path.relative_to(root))] = module
    assert offenders == {}


def test_the_mesh_reaches_the_layers_through_the_spec():
    """A model built for a mesh constrains its activations on it; called outside that mesh it says so instead of
    running unsharded; built without one it runs anywhere."""
    cfg = load_config(model_name="ling2-micro")
    mesh = jax.make_mesh((1,) * len(MESH_AXES), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))
    spec = ModelSpec.of(cfg, mesh)
    assert dict(spec.run.mesh_shape) == dict(mesh.shape) and ModelSpec.of(cfg).run.mesh_shape == ()
    ids = jnp.ones((1, 8), jnp.int32)
    on_mesh = Ling2Model(spec, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="built for the mesh .* runs under no mesh"):
        on_mesh(ids)
    with jax.set_mesh(mesh):
        got = on_mesh(ids).logits
    want = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))(ids).logits
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
