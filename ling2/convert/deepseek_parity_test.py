"""Logit parity with an independent published implementation: transformers' DeepseekV3ForCausalLM.

A tiny random DeepSeek-V3 (fp32, CPU) is saved by transformers as sharded safetensors,
converted to Ling2 through the deepseek_v3 layout (all-MLA Ling2 config), and Ling2's
logits must match transformers' to <= 1e-4, with its router's renormalised (norm_topk_prob) and
raw sigmoid weights alike. The reverse conversion must give tensors bit-identical to transformers'
and a directory `from_pretrained` loads.
"""

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ling2.convert import convert
from ling2.checkpoint.safetensors_io import ShardedReader
from ling2.checkpoint.state import load_into
from ling2.layers.model import Ling2Model
from ling2.layers.spec import ModelSpec

B, T = 2, 12


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_deepseek(q_lora_rank, rope_scaling=None, norm_topk_prob=True):
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, v_head_dim=8,
        qk_nope_head_dim=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
        rope_interleave=True, rope_scaling=rope_scaling, tie_word_embeddings=False, attn_implementation="eager")
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and expert biases, so a mis-mapped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(0.2 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    return model


@pytest.mark.parametrize("q_lora_rank,rope_scaling,norm_topk_prob",
                         [(12, None, True), (None, None, True), (12, YARN, True), (12, None, False)])
def test_deepseek_v3_logit_parity_and_reverse(tmp_path, q_lora_rank, rope_scaling, norm_topk_prob):
    hf = tiny_deepseek(q_lora_rank, rope_scaling, norm_topk_prob)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    cfg = convert.convert_hf_to_ling2(tmp_path / "hf", tmp_path / "l2", layout="auto", progress=False,
                                      overrides=["dtype=float32"])
    assert set(cfg.layer_types) == {"mla"} and cfg.inhomogeneous_layer_cycle_interval == 1
    assert cfg.q_lora_rank == (q_lora_rank or 0)
    assert cfg.rope_type == ("yarn" if rope_scaling else "default")
    assert cfg.sigmoid_renormalize == norm_topk_prob
    model = nnx.eval_shape(lambda: Ling2Model(ModelSpec.of(cfg), rngs=nnx.Rngs(1)))
    load_into(model, tmp_path / "l2", cfg)

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(nnx.jit(lambda m, x: m.decoder(x).logits)(model, ids))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

    convert.convert_ling2_to_hf(tmp_path / "l2", tmp_path / "hf2", layout="deepseek_v3", progress=False,
                                shard_bytes=64 << 10)
    ref, out = hf.state_dict(), ShardedReader(tmp_path / "hf2")
    assert set(out.names()) == set(ref)
    for name in ref:
        assert np.array_equal(out.read(name), ref[name].numpy()), name
    back = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert back.config.norm_topk_prob == norm_topk_prob
    with torch.no_grad():
        np.testing.assert_allclose(back(torch.from_numpy(ids)).logits.numpy(), want, atol=1e-5, rtol=0)
