"""The attention registry: every kind a config can name has its spec, module, FLOP count, cache type and HF
mapping, and they agree with each other (the module builds from its spec alone, the cache type is what the
module's init_cache returns; the HF mapping names every weight of the module)."""

import pytest
from flax import nnx

from ling2.config import load_config
from ling2.config.kinds import KINDS
from ling2.config.specs import Spec
from ling2.layers.attention.decode import CachedAttention
from ling2.layers.attention.registry import ATTENTION

MODELS = {"mla": "ling2-tiny", "gla": "ling2-tiny", "kda": "ling3-tiny"}


def test_every_layer_type_is_registered():
    assert set(KINDS) == set(ATTENTION)


@pytest.mark.parametrize("kind", sorted(ATTENTION))
@pytest.mark.parametrize("layout", ["bailing", "deepseek_v3"])
def test_kind_entry_is_complete_and_consistent(kind, layout):
    cfg = load_config(model_name=MODELS[kind])
    entry = ATTENTION[kind]
    spec = entry.spec.of(cfg)
    assert isinstance(spec, Spec) and hash(spec) == hash(entry.spec.of(cfg))  # frozen, a static module field
    module = nnx.eval_shape(lambda: entry.module(spec, rngs=nnx.Rngs(0)))
    assert isinstance(module, CachedAttention)  # init_cache, prefill, step, accept, unpack
    assert isinstance(nnx.eval_shape(lambda: module.init_cache(2, 8)), entry.cache)
    assert entry.matmul_params(spec) > 0 and entry.mixing_flops(spec, 64) > 0
    weights = {("attention",) + tuple(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    mapped = {tuple(map(str, sub)) for _, sub, *_ in entry.hf_params(layout)}
    assert weights and weights <= mapped, sorted(weights - mapped)


def test_packed_prefill_capability_matches_unpack():
    """A kind without packed prefill refuses to unpack; generation reads the capability, not the kind."""
    assert {k for k, e in ATTENTION.items() if not e.packed_prefill} == {"kda"}
    cfg = load_config(model_name=MODELS["kda"])
    module = nnx.eval_shape(lambda: ATTENTION["kda"].module(ATTENTION["kda"].spec.of(cfg), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="packed prefill is not supported"):
        module.unpack(None, None, None)
