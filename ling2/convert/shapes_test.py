"""The config-derived leaf shapes equal the traced model's state (jax.eval_shape), key order included."""

import jax
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.convert import convert, shapes
from ling2.layers.mtp import DecoderWithMTP


def traced(cfg) -> list:
    """[(path, shape, dtype)] of DecoderWithMTP(cfg)'s pure-dict state, as nnx orders it (the reference)."""
    model = jax.eval_shape(lambda: DecoderWithMTP(cfg, rngs=nnx.Rngs(0)))
    return [(p, tuple(v.shape), v.dtype) for p, v in convert._flat(nnx.to_pure_dict(nnx.state(model))).items()]


@pytest.mark.parametrize("overrides", [
    (),
    ("scan_layers=true",),  # prefix, stacked groups and suffix
    ("scan_layers=true", "base_num_decoder_layers=12", "first_num_dense_layers=0", "weight_dtype=bfloat16"),
    ("q_lora_rank=0", "use_qk_norm=false", "shared_experts=0", "logits_via_embedding=true", "mtp_num_layers=2"),
])
def test_leaf_specs_equal_the_traced_model(overrides):
    cfg = load_config(model_name="ling2-tiny", *overrides)
    want = traced(cfg)
    got = [(p, tuple(s), d) for p, (s, d) in shapes.leaf_specs(cfg).items()]
    assert got == want
