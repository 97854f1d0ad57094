"""Module specs: each is a frozen, hashable slice of the Config that every model file can derive, with the
Config's own values (fields named as the Config's, or as specs.SOURCE maps them)."""

import dataclasses
import types

import pytest

from ling2.config import load_config, specs
from ling2.config.enums import ModelName

SPECS = [specs.PlanSpec, specs.WeightsSpec, specs.RopeSpec, specs.EmbedSpec, specs.MLASpec, specs.GLASpec,
         specs.KDASpec, specs.RouterSpec, specs.MoESpec]


@pytest.mark.parametrize("model", [m for m in ModelName.__args__ if m != "default"])
def test_every_spec_derives_from_every_model(model):
    cfg = load_config(model_name=model)
    for cls in SPECS:
        spec = cls.of(cfg)
        hash(spec)  # frozen and hashable: a static field of an nnx module
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.emb_dim = 1
        for f in dataclasses.fields(cls):
            if f.name == "run":
                assert spec.run == specs.RunSpec.of(cfg)
                continue
            want = getattr(cfg, specs.SOURCE.get(f.name, f.name))
            assert getattr(spec, f.name) == (tuple((n, tuple(a) if a else a) for n, a in want)
                                             if f.name == "logical_axis_rules" else want), f.name


def test_a_spec_is_a_slice_not_the_whole_config():
    cfg = load_config(model_name="ling3-tiny")
    kda = specs.KDASpec.of(cfg)
    assert kda.kda_conv_kernel_size == cfg.kda_conv_kernel_size
    assert not hasattr(kda, "gla_chunk_size") and not hasattr(kda, "num_experts")
    assert len(dataclasses.fields(specs.MoESpec)) < len(type(cfg).model_fields) / 2


def test_base_keys_are_read_under_the_modules_names():
    """The YAML keeps MaxText's base_* keys; the Config has no identity aliases of them, the specs do."""
    cfg = load_config(model_name="ling2-tiny", base_emb_dim=96, base_num_query_heads=3, base_num_kv_heads=3)
    assert not hasattr(cfg, "emb_dim") and not hasattr(cfg, "num_query_heads")
    gla = specs.GLASpec.of(cfg)
    assert (gla.emb_dim, gla.num_query_heads, gla.num_decoder_layers) == (96, 3, cfg.base_num_decoder_layers)


def test_the_run_spec_holds_how_never_what():
    """Every RunSpec field is a Config field a resumed run may change (kernels, chunking, remat, scan, loss
    blocks, FP8, sharding rules), each kind's kernel fields among them; the mesh comes from the mesh given."""
    from ling2.config.kinds import KINDS
    from ling2.config.schema import resume_class

    cfg = load_config(model_name="ling3-tiny", gla_backend="chunked", remat_policy="full")
    run = specs.RunSpec.of(cfg)
    names = [f.name for f in dataclasses.fields(specs.RunSpec) if f.name != "mesh_shape"]
    assert {n: resume_class(n) for n in names if resume_class(n) == "fixed"} == {}
    assert {f for kind in KINDS.values() for f in kind.free_on_resume} <= set(names)
    assert (run.gla_backend, run.remat_policy, run.mesh_shape) == ("chunked", "full", ())
    mesh = types.SimpleNamespace(shape={"data": 2, "context": 4})
    assert specs.RunSpec.of(cfg, mesh).mesh_shape == (("data", 2), ("context", 4))
    kda = specs.KDASpec.of(cfg, mesh)
    assert kda.run == specs.RunSpec.of(cfg, mesh) and not hasattr(kda, "kda_backend")
