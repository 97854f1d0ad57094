"""Generation with KDA layers (Ling 3): the conv window and delta-rule state through prefill, decode and
MTP speculation.

- greedy output equals an independent oracle: argmax of a full no-cache forward of the growing sequence
  (`greedy_by_full_forward`), with left-padded prompts shorter and longer than the conv window;
- speculative decoding with drafts forced right or wrong in a pattern (so KDA layers roll their state
  and conv window back to a partial acceptance) gives the same tokens;
- packed prefill is refused with a named error.
"""

import pytest
from flax import nnx

from ling2.config import load_config
from ling2.infer import generation
from ling2.infer.generation import Generator, InferError
from ling2.infer.load import INFER_OVERRIDES
from ling2.infer.testing.models import greedy_by_full_forward, oracle_drafts, prompts
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec

N = 9
LENGTHS = (6, 2, 21)


@pytest.fixture(scope="module")
def ling3():
    # K M K: a KDA layer on each side of the gated MLA; init_std 0.1 keeps greedy argmaxes away from ties.
    cfg = load_config({"model_name": "ling3-tiny", "init_std": 0.1, "base_num_decoder_layers": 3,
                       "inhomogeneous_layer_cycle_interval": 2}, INFER_OVERRIDES)
    assert cfg.layer_types == ("kda", "mla", "kda")
    model = Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(0))
    g = Generator(model)
    ps = prompts(cfg.vocab_size, LENGTHS)
    return model, g, ps, g.generate(ps, N)


def test_greedy_equals_full_forward_oracle(ling3):
    model, _, ps, plain = ling3
    assert plain.ids == greedy_by_full_forward(model, ps, N)


def test_speculative_rolls_kda_state_and_conv_back(ling3, monkeypatch):
    model, _, ps, plain = ling3
    wrong = lambda b, c, j: (b + c + j) % 3 == 0  # noqa: E731
    monkeypatch.setattr(generation, "_draft", oracle_drafts(plain.ids, N, wrong))
    out = Generator(model).generate(ps, N, speculative=True)
    assert out.ids == plain.ids
    assert 0 < out.stats["acceptance_per_depth"][0] < 1


def test_packed_prefill_refused(ling3):
    _, g, ps, _ = ling3
    with pytest.raises(InferError, match="packed prefill is not supported for models with KDA"):
        g.generate(ps, N, packed=True)
