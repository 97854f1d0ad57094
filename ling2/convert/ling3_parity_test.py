"""Ling 3 parity with an independent published implementation: transformers 5.23's bailing_hybrid.

A tiny random BailingHybridForCausalLM (fp32, CPU; KDA + gated MLA + MoE, a trailing partial
group that stays KDA) is saved by transformers itself (on-disk Ling names, alias config keys),
converted to Ling2, and Ling2's logits must match transformers' (its pure-torch KDA fallback) to
1e-4; greedy decoding (transformers' `generate` with its KDA/MLA caches vs Ling2's generator) must
give the same tokens. The reverse conversion must give tensors bit-identical to the saved ones, a
config.json transformers loads and the same logits.

Needs transformers 5.x: runs in the test-only venv of `tools/bazel` (requirements-ling3.in).
"""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from ling2.checkpoint.safetensors_io import ShardedReader
from ling2.checkpoint.state import load_into
from ling2.convert import convert, hf_config
from ling2.infer.generation import generate
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec

pytestmark = pytest.mark.skipif(not hasattr(transformers, "BailingHybridForCausalLM"),
                                reason=f"transformers {transformers.__version__} has no bailing_hybrid (needs 5.x)")
B, T = 2, 37  # T not a multiple of the KDA chunk


def tiny_ling3(safe_gate=True, layers=5, renormalize=True):
    torch.manual_seed(0)
    cfg = transformers.BailingHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, layer_group_size=3, num_mtp_layers=0, kda_safe_gate=safe_gate,
        norm_topk_prob=renormalize,
        rope_theta=10000.0, pad_token_id=0, eos_token_id=1, attn_implementation="eager")
    model = transformers.BailingHybridForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and expert biases, so a mis-mapped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.ndim == 2 and "embed" not in name:
                p.copy_(0.15 * torch.randn_like(p))
            elif p.ndim == 3 and "experts" in name:
                p.copy_(0.15 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    return model


def _converted(tmp_path, hf):
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "num_experts" in saved and "linear_head_dim" in saved  # the alias names and the overwritten head_dim
    assert hf_config.detect_layout(saved) == "bailing_hybrid"
    cfg = convert.convert_hf_to_ling2(tmp_path / "hf", tmp_path / "l2", progress=False,
                                      overrides=["dtype=float32", "kda_backend=chunked"])
    model = nnx.eval_shape(lambda: Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(1)))
    load_into(model, tmp_path / "l2", cfg)
    return cfg, model


@pytest.mark.parametrize("safe_gate", [True, False])
def test_ling3_logit_parity_and_reverse(tmp_path, safe_gate):
    hf = tiny_ling3(safe_gate)
    cfg, model = _converted(tmp_path, hf)
    assert cfg.layer_types == ("kda", "kda", "mla", "kda", "kda")  # the trailing partial group stays KDA
    assert cfg.head_dim == 16 and cfg.qk_rope_head_dim == 8 and cfg.kda_safe_gate == safe_gate

    ids = np.random.default_rng(0).integers(2, cfg.vocab_size, (B, T))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(nnx.jit(lambda m, x: m.decoder(x).logits)(model, ids))
    assert np.abs(want).max() > 0.1
    print(f"ling3 parity (safe_gate={safe_gate}): max |logit diff| = {np.abs(got - want).max():.3g}")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    convert.convert_ling2_to_hf(tmp_path / "l2", tmp_path / "hf2", progress=False, shard_bytes=64 << 10)
    ref, out = ShardedReader(tmp_path / "hf"), ShardedReader(tmp_path / "hf2")
    assert set(out.names()) == set(ref.names())
    for name in ref.names():
        assert np.array_equal(out.read(name), ref.read(name)), name
    back = transformers.BailingHybridForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert back.config.linear_head_dim == 16 and back.config.layer_types == hf.config.layer_types
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.from_numpy(ids)).logits.numpy(), want, atol=1e-5, rtol=0)


def test_ling3_unnormalised_routing_parity(tmp_path):
    """moe_renormalize false: transformers weights the experts by the raw sigmoid scores times
    routed_scaling_factor; so must Ling2, and the export must say false again."""
    hf = tiny_ling3(renormalize=False)
    cfg, model = _converted(tmp_path, hf)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["moe_renormalize"] is False
    assert not cfg.sigmoid_renormalize
    ids = np.random.default_rng(1).integers(2, cfg.vocab_size, (B, T))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(nnx.jit(lambda m, x: m.decoder(x).logits)(model, ids))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    convert.convert_ling2_to_hf(tmp_path / "l2", tmp_path / "hf2", progress=False)
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["moe_renormalize"] is False
    back = transformers.BailingHybridForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert back.config.norm_topk_prob is False
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.from_numpy(ids)).logits.numpy(), want, atol=1e-5, rtol=0)


def test_ling3_greedy_decoding_matches_transformers(tmp_path):
    hf = tiny_ling3()
    cfg, model = _converted(tmp_path, hf)
    prompt = np.random.default_rng(3).integers(2, cfg.vocab_size, (1, 11))
    N = 12
    with torch.no_grad():
        want = hf.generate(torch.from_numpy(prompt), max_new_tokens=N, do_sample=False, eos_token_id=None,
                           pad_token_id=0, min_new_tokens=N)[0, prompt.shape[1]:].tolist()
    with jax.default_matmul_precision("highest"):
        got = generate(model, [prompt[0].tolist()], N).ids[0]
    print(f"ling3 greedy: transformers {want}, ling2 {got}")
    assert got == want


def test_layout_dispatch_on_architectures():
    base = {"model_type": "bailing_hybrid"}
    assert hf_config.detect_layout({**base, "architectures": ["BailingHybridForCausalLM"]}) == "bailing_hybrid"
    assert hf_config.detect_layout({**base, "architectures": ["BailingMoeV3ForCausalLM"]}) == "bailing_hybrid"
    assert hf_config.detect_layout({**base, "architectures": ["BailingMoeV2_5ForCausalLM"]}) == "bailing"
    with pytest.raises(hf_config.HFConfigError, match="architectures"):
        hf_config.detect_layout({**base, "architectures": ["SomethingElse"]})
