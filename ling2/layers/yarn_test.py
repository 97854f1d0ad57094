"""Yarn frequencies and scales against transformers' ROPE_INIT_FUNCTIONS (PyPI, 4.57) and hand values."""

import math

import numpy as np
import pytest

from ling2.config import load_config
from ling2.layers import yarn


def test_default_is_theta_power_and_ignores_factor():
    cfg = load_config(model_name="ling2", rope_type="default")  # ling2.yml sets rope_factor 32
    dim = cfg.rotary_dim
    np.testing.assert_allclose(yarn.rope_inv_freq(cfg), 10000.0 ** (-np.arange(0, dim, 2) / dim), rtol=1e-6)
    assert yarn.rope_attention_scaling(cfg) == 1.0
    assert yarn.mla_softmax_scale(cfg) == pytest.approx(192 ** -0.5)


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 0.0), (1.0, 1.0), (0.707, 1.0)])
def test_yarn_matches_transformers(mscale, mscale_all_dim):
    pytest.importorskip("torch")
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = load_config(model_name="ling2", rope_type="yarn", rope_factor=32.0, mscale=mscale,
                      mscale_all_dim=mscale_all_dim, original_max_position_embeddings=4096,
                      max_position_embeddings=131072)
    hf = PretrainedConfig(rope_theta=cfg.rope_max_timescale, head_dim=cfg.head_dim, hidden_size=cfg.base_emb_dim,
                          num_attention_heads=cfg.base_num_query_heads, partial_rotary_factor=cfg.partial_rotary_factor,
                          max_position_embeddings=cfg.max_position_embeddings,
                          rope_scaling={"rope_type": "yarn", "factor": cfg.rope_factor, "mscale": mscale,
                                        "mscale_all_dim": mscale_all_dim, "beta_fast": cfg.beta_fast,
                                        "beta_slow": cfg.beta_slow,
                                        "original_max_position_embeddings": cfg.original_max_position_embeddings})
    inv, amp = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    np.testing.assert_allclose(yarn.rope_inv_freq(cfg), inv.numpy(), rtol=1e-6)
    assert yarn.rope_attention_scaling(cfg) == pytest.approx(amp, rel=1e-12)
    # Hand value: 0.1 * ln(32) + 1 = 1.34657...; MLA scale = 192^-0.5 * m^2 only with mscale_all_dim.
    m = 0.1 * mscale_all_dim * math.log(32) + 1 if mscale_all_dim else 1.0
    assert yarn.mla_softmax_scale(cfg) == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)
    assert yarn.get_mscale(32, 1.0) == pytest.approx(1.3465735902799727)


def test_yarn_ends_of_the_ramp():
    """High-frequency dims keep theta^(-2i/d); the lowest-frequency dims are divided by the factor."""
    cfg = load_config(model_name="ling2", rope_type="yarn", rope_factor=32.0)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    inv = yarn.rope_inv_freq(cfg)
    assert inv[0] == pytest.approx(base[0], rel=1e-6)
    assert inv[-1] == pytest.approx(base[-1] / 32, rel=1e-6)


def test_unknown_rope_type_is_an_error():
    class Bad:
        rope_type = "ntk"

    with pytest.raises(ValueError, match="rope_type"):
        yarn.rope_inv_freq(Bad())


def test_long_context_stage_stretches_the_slow_dims_only():
    """configs/train/ling2-128k.yml (YaRN factor 32 over 4K): the fastest rotary frequency is the
    pre-trained one, the slowest is divided by the factor (NTK-by-parts' two ends)."""
    import dataclasses

    from ling2.config import load_config
    from ling2.config.paths import find_file
    from ling2.config.specs import RopeSpec
    from ling2.layers import yarn

    spec = RopeSpec.of(load_config(config_file=find_file("configs/train/ling2-128k.yml")))
    base = yarn.rope_inv_freq(dataclasses.replace(spec, rope_type="default"))
    stretched = yarn.rope_inv_freq(spec)
    assert stretched[0] == base[0] and abs(stretched[-1] * 32 / base[-1] - 1) < 1e-6
