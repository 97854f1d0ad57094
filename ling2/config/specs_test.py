"""Module specs: each is a frozen, hashable slice of the Config that every model file can derive, with the
Config's own values (fields named as the Config's)."""

import dataclasses

import pytest

from ling2.config import load_config, specs
from ling2.config.enums import ModelName

SPECS = [specs.WeightsSpec, specs.RopeSpec, specs.EmbedSpec, specs.MLASpec, specs.GLASpec, specs.KDASpec,
         specs.RouterSpec, specs.MoESpec]


@pytest.mark.parametrize("model", [m for m in ModelName.__args__ if m != "default"])
def test_every_spec_derives_from_every_model(model):
    cfg = load_config(model_name=model)
    for cls in SPECS:
        spec = cls.of(cfg)
        hash(spec)  # frozen and hashable: a static field of an nnx module
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.emb_dim = 1 if hasattr(spec, "emb_dim") else spec.rotary_dim
        for f in dataclasses.fields(cls):
            want = getattr(cfg, f.name)
            assert getattr(spec, f.name) == (tuple((n, tuple(a) if a else a) for n, a in want)
                                             if f.name == "logical_axis_rules" else want), f.name


def test_a_spec_is_a_slice_not_the_whole_config():
    cfg = load_config(model_name="ling3-tiny")
    kda = specs.KDASpec.of(cfg)
    assert kda.kda_conv_kernel_size == cfg.kda_conv_kernel_size
    assert not hasattr(kda, "gla_chunk_size") and not hasattr(kda, "num_experts")
    assert len(dataclasses.fields(specs.MoESpec)) < len(type(cfg).model_fields) / 2
