"""The GLA layer against an explicit numpy computation of the whole layer.

Reference: every step of model.md's linear-attention layer written here in float64 numpy
(projections, SiLU, qk RMSNorm, rotate-half RoPE, ALiBi slopes from the closed form,
GroupRMSNorm, sigmoid gate, output projection), with the recurrence from
flash-linear-attention's `naive_recurrent_simple_gla` (fla-core, torch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.kernels.testing import fla_reference
from ling2.layers.attention import decode
from ling2.layers.attention.gla import GatedLinearAttention, alibi_base_slopes, layer_slopes
from ling2.config.specs import GLASpec

B, T = 2, 20
_call = nnx.jit(lambda m, x, p, s=None, i=2: m(x, p, s, layer_index=i), static_argnames="i")
_OPTS = decode.DecodeOptions()
# GLA's prefill and step need no slot bookkeeping (the recurrent state is the whole cache).
_prefill = nnx.jit(lambda m, x, p, c, i: m.prefill(x, p, jnp.ones(x.shape[:2], jnp.int32), c, None, _OPTS,
                                                   layer_index=i), static_argnames="i")
_step = nnx.jit(lambda m, x, p, c, i: m.step(x, p, jnp.ones(x.shape[:2], jnp.int32), c, None, _OPTS, layer_index=i),
                static_argnames="i")


def _cfg(**overrides):
    return load_config(model_name="ling2-tiny", **overrides)


def _np_layer(cfg, params, x, positions, layer_idx, offset=-1):
    """Whole layer in float64 numpy; one document per row."""
    H, D, L, G = cfg.base_num_query_heads, cfg.head_dim, cfg.base_num_decoder_layers, cfg.group_norm_size
    eps, R = cfg.normalization_layer_epsilon, cfg.rotary_dim
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    qkv = np.einsum("bte,eshd->btshd", x, p["qkv"])
    if cfg.use_linear_silu:
        qkv = qkv / (1 + np.exp(-qkv))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    rms = lambda a, w: a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps) * w
    if cfg.use_qk_norm:
        q, k = rms(q, p["q_norm"]), rms(k, p["k_norm"])
    inv = 1.0 / cfg.rope_max_timescale ** (np.arange(0, R, 2) / R)
    ang = positions[..., None, None] * inv  # [B, T, 1, R/2]
    c, s = np.cos(ang), np.sin(ang)

    def rope(a):
        a1, a2 = a[..., :R // 2], a[..., R // 2:R]
        return np.concatenate([a1 * c - a2 * s, a2 * c + a1 * s, a[..., R:]], -1)

    q, k = rope(q), rope(k)
    start = 2.0 ** (-(2.0 ** -(np.log2(H) - 3)))  # H is a power of two in ling2-tiny
    slope = start ** np.arange(1, H + 1) * (1 - (layer_idx + offset) / (L - 1) + 1e-5)
    g = np.broadcast_to(-slope, (x.shape[0], x.shape[1], H))
    o, _ = fla_reference.recurrent(q, k, v, g)  # scale D^-0.5
    o = o.reshape(*x.shape[:2], G, H * D // G)
    o = (o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps)).reshape(*x.shape[:2], H * D) * p["g_norm"]
    gate = 1 / (1 + np.exp(-np.einsum("bte,ehd->bthd", x, p["g_proj"])))
    return np.einsum("bthd,hde->bte", o.reshape(*x.shape[:2], H, D) * gate, p["dense"])


def _params(layer):
    out = {"qkv": layer.qkv[...], "g_proj": layer.g_proj[...], "dense": layer.dense[...],
           "g_norm": layer.g_norm.weight[...]}
    if layer.use_qk_norm:
        out.update(q_norm=layer.q_norm.weight[...], k_norm=layer.k_norm.weight[...])
    return out


def _randomize_norms(layer, seed):
    """Non-trivial norm weights so the test sees them."""
    r = np.random.default_rng(seed)
    for norm in (layer.g_norm, getattr(layer, "q_norm", None), getattr(layer, "k_norm", None)):
        if norm is not None:
            norm.weight[...] = jnp.asarray(r.uniform(0.5, 1.5, norm.weight.shape), jnp.float32)


def _inputs(seed=0, t=T):
    x = np.random.default_rng(seed).standard_normal((B, t, 128)).astype(np.float32)
    return x, np.broadcast_to(np.arange(t), (B, t))


@pytest.mark.parametrize("overrides, layer_idx", [
    ({}, 2),
    ({"use_linear_silu": True, "group_norm_size": 1, "gla_slope_layer_offset": 0}, 0),
])
def test_layer_matches_numpy_reference(overrides, layer_idx):
    cfg = _cfg(**overrides)
    layer = GatedLinearAttention(GLASpec.of(cfg), rngs=nnx.Rngs(0))
    _randomize_norms(layer, 1)
    x, pos = _inputs()
    got = _call(layer, jnp.asarray(x), jnp.asarray(pos), i=layer_idx)
    want = _np_layer(cfg, _params(layer), x.astype(np.float64), pos, layer_idx, cfg.gla_slope_layer_offset)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_packed_documents_match_separate_runs():
    cfg = _cfg()
    layer = GatedLinearAttention(GLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, _ = _inputs(2)
    cut = 7
    seg = np.array([[0] * cut + [1] * (T - cut)] * B)
    pos = np.concatenate([np.arange(cut), np.arange(T - cut)])[None].repeat(B, 0)
    packed = _call(layer, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(seg))
    first = _call(layer, jnp.asarray(x[:, :cut]), jnp.asarray(pos[:, :cut]))
    second = _call(layer, jnp.asarray(x[:, cut:]), jnp.asarray(pos[:, cut:]))
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], 1), rtol=1e-5, atol=1e-6)


def test_prefill_then_decode_matches_full_sequence():
    cfg = _cfg()
    layer = GatedLinearAttention(GLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, pos = _inputs(3, t=11)
    full = _call(layer, jnp.asarray(x), jnp.asarray(pos), i=3)
    out, cache = _prefill(layer, jnp.asarray(x[:, :8]), jnp.asarray(pos[:, :8]), layer.init_cache(B, 16), 3)
    outs = [out]
    for t in range(8, 11):
        o_t, cache = _step(layer, jnp.asarray(x[:, t:t + 1]), jnp.asarray(pos[:, t:t + 1]), cache, 3)
        outs.append(o_t)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-6)


def test_gradients_chunked_equal_naive_backend():
    x, pos = _inputs(4)

    def grads(backend):
        layer = GatedLinearAttention(GLASpec.of(_cfg(gla_backend=backend)), rngs=nnx.Rngs(0))
        loss = lambda m: jnp.sum(jnp.sin(m(jnp.asarray(x), jnp.asarray(pos), layer_index=2)))
        return nnx.grad(loss)(layer)

    for a, b in zip(jax.tree.leaves(grads("chunked")), jax.tree.leaves(grads("naive"))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


def test_slope_tables_closed_form():
    h = np.arange(16)
    np.testing.assert_allclose(alibi_base_slopes(16), 2.0 ** (-0.5 * (h + 1)), rtol=1e-12)
    # H = 12: the 8 slopes of H = 8 (2^-(h+1)), then every other slope of H = 16 (2^-0.5, 2^-1.5, ...).
    want12 = np.concatenate([2.0 ** -(np.arange(8) + 1.0), 2.0 ** -(np.arange(4) + 0.5)])
    np.testing.assert_allclose(alibi_base_slopes(12), want12, rtol=1e-12)
    # HF convention (offset -1): layer 0 of 20 scales by 1 + 1/19 + 1e-5; vLLM (offset 0) by 1 + 1e-5.
    np.testing.assert_allclose(layer_slopes(16, 0, 20), 2.0 ** (-0.5 * (h + 1)) * (1 + 1 / 19 + 1e-5))
    np.testing.assert_allclose(layer_slopes(16, 0, 20, offset=0), 2.0 ** (-0.5 * (h + 1)) * (1 + 1e-5))
    np.testing.assert_allclose(layer_slopes(16, 19, 20, offset=0), 2.0 ** (-0.5 * (h + 1)) * 1e-5, rtol=1e-9)
    with pytest.raises(ValueError, match="layer_idx"):
        layer_slopes(16, 20, 20)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: run under Bazel (devices = 4)")
@pytest.mark.parametrize("backend", ["chunked", "pallas_tpu", "pallas_gpu"])  # Pallas in interpret mode on CPU
def test_sharded_layer_matches_single_device(backend):
    """Batch over data, heads over tensor: shard_map around the kernel; output and weight gradients agree."""
    cfg = _cfg(ici_data_parallelism=2, ici_fsdp_parallelism=1, ici_tensor_parallelism=2, gla_backend=backend)
    layer = GatedLinearAttention(GLASpec.of(cfg), rngs=nnx.Rngs(0))
    x, pos = _inputs(5)
    x, pos, seg = jnp.asarray(x), jnp.asarray(pos), jnp.asarray([[0] * 9 + [1] * (T - 9)] * B)
    loss = lambda m, x: jnp.sum(jnp.sin(m(x, pos, seg, layer_index=2)))
    out_and_grad = nnx.jit(lambda m, x: (m(x, pos, seg, layer_index=2), nnx.grad(loss)(m, x)))
    want, want_grads = out_and_grad(layer, x)
    axes = ("data", "fsdp", "expert", "tensor")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 1, 1, 2), axes,
                             axis_types=(jax.sharding.AxisType.Auto,) * 4)
    layer = GatedLinearAttention(GLASpec.of(cfg, mesh), rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x, pos, seg, layer_index=2))(x))
        got, got_grads = out_and_grad(layer, x)
    assert "shard_map" in jaxpr
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_bf16_compute_close_to_fp32():
    x, pos = _inputs(6)
    outs = []
    for dtype in ("float32", "bfloat16"):
        layer = GatedLinearAttention(GLASpec.of(_cfg(dtype=dtype)), rngs=nnx.Rngs(0))
        outs.append(_call(layer, jnp.asarray(x), jnp.asarray(pos)))
    assert outs[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(outs[1], np.float32), outs[0], rtol=0,
                               atol=3e-2 * float(jnp.abs(outs[0]).max()))
