"""MLA against (a) a float64 numpy implementation written out below from the math in
docs/model.md, (b) transformers' DeepseekV3Attention (PyPI, torch CPU) loaded with the
same weights; plus backends, KV-cache decode, causality and packing isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers import yarn
from ling2.layers.attention import mla as attention_mla
from ling2.layers.attention import decode
from ling2.config.specs import MLASpec


def tiny(**kw):
    base = dict(model_name="ling2-tiny", base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, head_dim=16, q_lora_rank=12,
                kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=5, dtype="float32",
                init_std=0.2)
    base.update(kw)
    return load_config(**base)


def params64(m):
    return {k: np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))
            for k in ["/".join(map(str, k))]}


def rope64(x, pos, inv_freq, amp, interleaved):
    """Complex-pair rotation: pairs (2i, 2i+1) when interleaved, else (i, i + R/2)."""
    R = x.shape[-1]
    z = x[..., 0::2] + 1j * x[..., 1::2] if interleaved else x[..., :R // 2] + 1j * x[..., R // 2:]
    rot = np.exp(1j * pos[..., None] * inv_freq)  # [B, T, R/2]
    z = z * (rot[:, :, None] if z.ndim == 4 else rot) * amp
    return np.concatenate([z.real, z.imag], axis=-1)


def mla64(cfg, p, x, pos, seg):
    """MLA in float64 numpy, one softmax per (batch, head, query)."""
    Dn = cfg.qk_nope_head_dim
    norm = lambda a, w: w * a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6)
    if cfg.q_lora_rank:
        q = np.einsum("btr,rhk->bthk", norm(x @ p["q_a"], p["q_a_norm/weight"]), p["q_b"])
    else:
        q = np.einsum("bte,ehk->bthk", x, p["q"])
    kv_a = x @ p["kv_a"]
    kv = np.einsum("btr,rhk->bthk", norm(kv_a[..., :cfg.kv_lora_rank], p["kv_a_norm/weight"]), p["kv_b"])
    inv, amp = yarn.rope_inv_freq(cfg).astype(np.float64), yarn.rope_attention_scaling(cfg)
    q_r = rope64(q[..., Dn:], pos, inv, amp, cfg.mla_interleaved_rope)
    k_r = rope64(kv_a[..., cfg.kv_lora_rank:], pos, inv, amp, cfg.mla_interleaved_rope)
    B, T, H, _ = q.shape
    scale = yarn.mla_softmax_scale(cfg)
    o = np.zeros((B, T, H, cfg.v_head_dim))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [s for s in range(t + 1) if seg[b, s] == seg[b, t]]
                logits = np.array([(q[b, t, h, :Dn] @ kv[b, s, h, :Dn] + q_r[b, t, h] @ k_r[b, s]) * scale
                                   for s in keys])
                w = np.exp(logits - logits.max())
                o[b, t, h] = (w / w.sum()) @ kv[b, keys, h, Dn:]
    return np.einsum("bthv,hve->bte", o, p["dense"])


def inputs(cfg, B=2, T=12, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, cfg.base_emb_dim)).astype(np.float32)
    seg = np.array([[1] * 5 + [2] * 7, [3] * 12])[:B, :T]
    pos = np.array([list(range(5)) + list(range(7)), list(range(12))])[:B, :T]
    return x, pos, seg


@pytest.mark.parametrize("kw", [
    dict(),
    dict(q_lora_rank=0, mla_interleaved_rope=False),
    dict(rope_type="yarn", rope_factor=8.0, mscale_all_dim=1.0, original_max_position_embeddings=64),
])
def test_matches_float64_reference(kw):
    cfg = tiny(**kw)
    m = attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, pos, seg = inputs(cfg)
    out = m(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg))
    ref = mla64(cfg, params64(m), x.astype(np.float64), pos, seg)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "blocked"])
def test_backends_match_dot_product(kernel):
    cfg = tiny()
    x, pos, seg = inputs(cfg, T=128 if kernel == "flash" else 12)
    if kernel == "flash":
        seg = np.repeat(np.array([[1] * 50 + [2] * 78, [3] * 128]), 1, 0)
        pos = np.where(seg[:, :] == 2, np.arange(128) - 50, np.arange(128))
        x = np.random.default_rng(1).normal(size=(2, 128, cfg.base_emb_dim)).astype(np.float32)
    ref_m = attention_mla.MLA(MLASpec.of(tiny(attention_kernel="dot_product")), rngs=nnx.Rngs(0))
    m = attention_mla.MLA(MLASpec.of(tiny(attention_kernel=kernel)), rngs=nnx.Rngs(0))
    args = jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg)
    np.testing.assert_allclose(np.asarray(m(*args)), np.asarray(ref_m(*args)), rtol=1e-4, atol=1e-5)


def test_blocked_layer_matches_float64_reference():
    """The layer with attention_kernel=blocked and blocks of 3 against the numpy MLA."""
    cfg = tiny(attention_kernel="blocked", attention_block_size=3)
    m = attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, pos, seg = inputs(cfg)
    out = m(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(out), mla64(cfg, params64(m), x.astype(np.float64), pos, seg),
                               rtol=2e-4, atol=2e-5)


def _cached(m, mode, x, pos, shared, layer_cache, absorb):
    seg = jnp.ones(x.shape[:2], jnp.int32)
    state = decode.begin(shared, seg)
    call = getattr(m, mode)
    out, layer_cache = call(jnp.asarray(x), jnp.asarray(pos), seg, layer_cache, state, decode.DecodeOptions(absorb))
    return np.asarray(out), decode.end(state, x.shape[1], None), layer_cache


@pytest.mark.parametrize("absorb", [True, False])
def test_kv_cache_decode_matches_full_forward(absorb):
    cfg = tiny()
    m = attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, pos, _ = inputs(cfg, B=2, T=9)
    pos = np.broadcast_to(np.arange(9), (2, 9))
    full = np.asarray(m(jnp.asarray(x), jnp.asarray(pos)))
    cache = m.init_cache(2, 16)
    shared = decode.empty(2, 16, None)
    out, shared, cache = _cached(m, "prefill", x[:, :4], pos[:, :4], shared, cache, absorb)  # prefill 4
    steps = [out]
    for t in range(4, 9):
        out, shared, cache = _cached(m, "step", x[:, t:t + 1], pos[:, t:t + 1], shared, cache, absorb)
        steps.append(out)
    assert np.asarray(shared.index).tolist() == [9, 9]
    np.testing.assert_allclose(np.concatenate(steps, 1), full, rtol=1e-4, atol=1e-5)
    over, *_ = _cached(m, "step", x, pos, shared, cache, absorb)  # 9 more tokens do not fit in 16 slots
    assert np.isnan(over).all()


def test_causal_and_packing_isolation():
    cfg = tiny()
    m = attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, pos, seg = inputs(cfg, B=1)
    base = np.asarray(m(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg)))
    x2 = x.copy()
    x2[:, 9:] += 1.0  # change the future: earlier outputs must not move
    out2 = np.asarray(m(jnp.asarray(x2), jnp.asarray(pos), jnp.asarray(seg)))
    np.testing.assert_array_equal(out2[:, :9], base[:, :9])
    alone = np.asarray(m(jnp.asarray(x[:, 5:]), jnp.asarray(pos[:, 5:]), jnp.asarray(seg[:, 5:])))
    np.testing.assert_allclose(base[:, 5:], alone, rtol=1e-5, atol=1e-6)


YARN = dict(rope_type="yarn", mscale=1.0, mscale_all_dim=1.0)


@pytest.mark.parametrize("cfg_kw", [
    dict(q_lora_rank=0, rope_factor=4.0, original_max_position_embeddings=8, max_position_embeddings=32),
    dict(rope_factor=4.0, original_max_position_embeddings=8, max_position_embeddings=32),
    dict(model_name="ling2", dtype="float32", init_std=0.02, rope_factor=32.0),  # Ling2's own MLA shapes
], ids=["tiny_q_proj", "tiny_q_lora", "ling2_shapes"])
def test_matches_transformers_deepseek_v3(cfg_kw):
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    cfg = load_config(**{**YARN, **cfg_kw}) if "model_name" in cfg_kw else tiny(**YARN, **cfg_kw)
    q_lora = cfg.q_lora_rank
    m = attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(3))
    p = params64(m)
    E, H = cfg.base_emb_dim, cfg.base_num_query_heads
    hf_cfg = ds.DeepseekV3Config(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora or None,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rope_theta=cfg.rope_max_timescale, rope_interleave=True, rms_norm_eps=1e-6,
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=False,
        rope_scaling={"rope_type": "yarn", "factor": cfg.rope_factor, "mscale": cfg.mscale,
                      "mscale_all_dim": cfg.mscale_all_dim, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
                      "original_max_position_embeddings": cfg.original_max_position_embeddings})
    hf_cfg._attn_implementation = "eager"
    attn = ds.DeepseekV3Attention(hf_cfg, layer_idx=0).double()
    rope = ds.DeepseekV3RotaryEmbedding(hf_cfg).double()
    t = lambda a: torch.tensor(a, dtype=torch.float64)
    with torch.no_grad():  # torch Linear weights are [out, in]
        if q_lora:
            attn.q_a_proj.weight.copy_(t(p["q_a"].T))
            attn.q_a_layernorm.weight.copy_(t(p["q_a_norm/weight"]))
            attn.q_b_proj.weight.copy_(t(p["q_b"].reshape(q_lora, -1).T))
        else:
            attn.q_proj.weight.copy_(t(p["q"].reshape(E, -1).T))
        attn.kv_a_proj_with_mqa.weight.copy_(t(p["kv_a"].T))
        attn.kv_a_layernorm.weight.copy_(t(p["kv_a_norm/weight"]))
        attn.kv_b_proj.weight.copy_(t(p["kv_b"].reshape(cfg.kv_lora_rank, -1).T))
        attn.o_proj.weight.copy_(t(p["dense"].reshape(-1, E).T))
        B, T = 2, 20
        x = np.random.default_rng(0).normal(size=(B, T, E))
        pos = torch.arange(T)[None].expand(B, T)
        causal = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None].expand(B, 1, T, T)
        ref, _ = attn(t(x), position_embeddings=rope(t(x), pos), attention_mask=causal)
    out = m(jnp.asarray(x, jnp.float32), jnp.asarray(pos.numpy()))
    np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=2e-4, atol=2e-5)


def test_param_shapes_and_logical_names():
    cfg = tiny()
    m = attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(0))
    got = {"/".join(map(str, k)): (v.shape, tuple(v.get_metadata()["out_sharding"]))
           for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}
    assert got == {
        "q_a": ((32, 12), ("embed", "q_lora")), "q_a_norm/weight": ((12,), ("norm",)),
        "q_b": ((12, 2, 14), ("q_lora", "heads", "kv")), "kv_a": ((32, 18), ("embed", "kv_lora")),
        "kv_a_norm/weight": ((10,), ("norm",)), "kv_b": ((10, 2, 11), ("kv_lora", "heads", "kv")),
        "dense": ((2, 5, 32), ("heads", "kv", "embed")),
    }
