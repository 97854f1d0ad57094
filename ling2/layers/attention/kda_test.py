"""The KDA layer against an explicit numpy computation of the whole layer.

Reference: every step of ling3.md fact 4 written here in float64 numpy (q/k/v projections, the
depthwise causal conv with w[:, K-1] on the current token, SiLU, L2 norm with the eps inside the
sqrt, the safe and unsafe gates, beta, the per-head gated RMSNorm, the output projection), with
the delta-rule recurrence from flash-linear-attention's `naive_recurrent_kda` (fla-core, torch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.kernels.testing import fla_reference
from ling2.layers.attention.kda import KimiDeltaAttention
from ling2.layers.attention.decode import DecodeOptions
from ling2.config.specs import KDASpec

B, T = 2, 20
_call = nnx.jit(lambda m, x, s=None: m(x, None, s))
# KDA's prefill and step need no slot bookkeeping (conv window and state are the whole cache).
_step = nnx.jit(lambda m, x, c, history=False: m.step(x, None, jnp.ones(x.shape[:2], jnp.int32), c, None,
                                                     DecodeOptions(history=history)), static_argnames="history")
_prefill = nnx.jit(lambda m, x, s, c: m.prefill(x, None, s, c, None, DecodeOptions()))


def _cfg(**overrides):
    return load_config(model_name="ling3-tiny", **overrides)


def _sig(a):
    return 1 / (1 + np.exp(-a))


def _np_layer(cfg, layer, x):
    """Whole layer in float64 numpy; one document per row."""
    K, eps = cfg.kda_conv_kernel_size, cfg.normalization_layer_epsilon
    p = {k: np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    Bx, Tx, _ = x.shape
    outs = []
    for name, conv in (("q_proj", "q_conv"), ("k_proj", "k_conv"), ("v_proj", "v_conv")):
        a = np.einsum("bte,ehd->bthd", x, p[(name,)])
        w = p[(conv,)]  # [H, D, K]
        y = np.zeros_like(a)
        for t in range(Tx):
            for j in range(K):
                src = t - (K - 1) + j
                if src >= 0:
                    y[:, t] += w[..., j] * a[:, src]
        outs.append(y * _sig(y))  # SiLU
    l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
    q, k, v = l2(outs[0]), l2(outs[1]), outs[2]
    f = np.einsum("bte,ehd->bthd", x, p[("f_proj",)]) + p[("dt_bias",)]
    a = np.exp(p[("A_log",)])[:, None]
    if cfg.kda_safe_gate:
        g = cfg.kda_lower_bound * _sig(a * f)
    else:
        g = -a * np.log1p(np.exp(f))
    beta = _sig(np.einsum("bte,eh->bth", x, p[("b_proj",)]))
    o = fla_reference.kda(q, k, v, g, beta)["o"]  # naive_recurrent_kda, scale D^-0.5
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * p[("o_norm", "weight")]
    o = o * _sig(np.einsum("bte,ehd->bthd", x, p[("g_proj",)]))
    return np.einsum("bthd,hde->bte", o, p[("dense",)])


def _randomize(layer, seed):
    """Non-trivial norm weights so the test sees them."""
    r = np.random.default_rng(seed)
    layer.o_norm.weight[...] = jnp.asarray(r.uniform(0.5, 1.5, layer.o_norm.weight.shape), jnp.float32)


def _inputs(seed=0, t=T):
    return np.random.default_rng(seed).standard_normal((B, t, 128)).astype(np.float32)


@pytest.mark.parametrize("overrides", [{}, {"kda_safe_gate": False}, {"kda_backend": "naive"}])
def test_layer_matches_numpy_reference(overrides):
    cfg = _cfg(**overrides)
    layer = KimiDeltaAttention(KDASpec.of(cfg), rngs=nnx.Rngs(0))
    _randomize(layer, 1)
    x = _inputs()
    got = _call(layer, jnp.asarray(x))
    want = _np_layer(cfg, layer, x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_safe_gate_bounded_and_unsafe_form():
    layer = KimiDeltaAttention(KDASpec.of(_cfg()), rngs=nnx.Rngs(0))
    x = jnp.asarray(_inputs(1)) * 50.0  # saturating gate inputs
    g = layer.gate(x)
    assert g.dtype == jnp.float32 and bool(jnp.all(g <= 0)) and bool(jnp.all(g >= -5.0))
    unsafe = KimiDeltaAttention(KDASpec.of(_cfg(kda_safe_gate=False)), rngs=nnx.Rngs(0))
    f = np.einsum("bte,ehd->bthd", np.asarray(x, np.float64), np.asarray(unsafe.f_proj[...], np.float64))
    f = f + np.asarray(unsafe.dt_bias[...], np.float64)
    want = -np.exp(np.asarray(unsafe.A_log[...], np.float64))[:, None] * np.logaddexp(0, f)
    np.testing.assert_allclose(unsafe.gate(x), want, rtol=1e-4, atol=1e-3)


def test_packed_documents_match_separate_runs():
    """Both the conv window and the delta-rule state restart at a document start."""
    layer = KimiDeltaAttention(KDASpec.of(_cfg()), rngs=nnx.Rngs(0))
    x = _inputs(2)
    cut = 7
    seg = np.array([[1] * cut + [2] * (T - cut)] * B)
    packed = _call(layer, jnp.asarray(x), jnp.asarray(seg))
    first = _call(layer, jnp.asarray(x[:, :cut]))
    second = _call(layer, jnp.asarray(x[:, cut:]))
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], 1), rtol=1e-5, atol=1e-6)
    unpacked = _call(layer, jnp.asarray(x))
    assert float(jnp.abs(unpacked[:, cut:cut + 3] - packed[:, cut:cut + 3]).max()) > 1e-3


def test_prefill_then_decode_matches_full_sequence():
    """Left-padded prefill (segment 0), a multi-token stepwise continuation with per-token states, then
    single steps, against the unpadded full sequence."""
    layer = KimiDeltaAttention(KDASpec.of(_cfg()), rngs=nnx.Rngs(0))
    x = _inputs(3, t=11)
    full = _call(layer, jnp.asarray(x))
    pad = 3
    xp = np.concatenate([np.random.default_rng(9).standard_normal((B, pad, 128)).astype(np.float32), x[:, :2]], 1)
    seg = jnp.asarray([[0] * pad + [1, 1]] * B)
    out, cache = _prefill(layer, jnp.asarray(xp), seg, layer.init_cache(B, 16))  # prompt shorter than the conv
    outs = [out[:, pad:]]
    before = cache
    out, cache = _step(layer, jnp.asarray(x[:, 2:8]), cache, history=True)
    outs.append(out)
    np.testing.assert_allclose(cache.history_state_BTHKV[:, -1], cache.state_BHKV)
    np.testing.assert_allclose(cache.history_conv_BTPCHD[:, -1], cache.conv_BPCHD)
    stepped = cache
    cache = cache.replace(history_conv_BTPCHD=None, history_state_BTHKV=None)
    for t in range(8, 11):
        o_t, cache = _step(layer, jnp.asarray(x[:, t:t + 1]), cache)
        outs.append(o_t)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    # rolling back to token 4 of the continuation (what speculative decoding does) and stepping on; a row
    # that is not live keeps the cache from before the continuation
    live = jnp.asarray([True] * (B - 1) + [False])
    back = layer.accept(before, stepped, jnp.full((B,), 3, jnp.int32), live)
    np.testing.assert_array_equal(back.state_BHKV[-1], before.state_BHKV[-1])
    o6, _ = _step(layer, jnp.asarray(x[:, 6:7]), back)
    o6 = o6[:B - 1]
    full = full[:B - 1]
    np.testing.assert_allclose(o6, full[:, 6:7], rtol=1e-5, atol=1e-5)


def test_gradients_chunked_equal_naive_backend():
    x = _inputs(4)
    seg = jnp.asarray([[1] * 9 + [2] * (T - 9)] * B)

    def grads(backend):
        layer = KimiDeltaAttention(KDASpec.of(_cfg(kda_backend=backend)), rngs=nnx.Rngs(0))
        loss = lambda m: jnp.sum(jnp.sin(m(jnp.asarray(x), None, seg)))
        return nnx.grad(loss)(layer)

    for a, b in zip(jax.tree.leaves(grads("chunked")), jax.tree.leaves(grads("naive"))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: run under Bazel (devices = 4)")
def test_sharded_layer_matches_single_device():
    """Batch over data, heads over tensor: shard_map around the kernel; output and weight gradients agree."""
    cfg = _cfg(ici_data_parallelism=2, ici_fsdp_parallelism=1, ici_tensor_parallelism=2, kda_backend="chunked")
    layer = KimiDeltaAttention(KDASpec.of(cfg), rngs=nnx.Rngs(0))
    x, seg = jnp.asarray(_inputs(5)), jnp.asarray([[1] * 9 + [2] * (T - 9)] * B)
    loss = lambda m, x: jnp.sum(jnp.sin(m(x, None, seg)))
    out_and_grad = nnx.jit(lambda m, x: (m(x, None, seg), nnx.grad(loss)(m, x)))
    want, want_grads = out_and_grad(layer, x)
    axes = ("data", "fsdp", "expert", "tensor")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 1, 1, 2), axes,
                             axis_types=(jax.sharding.AxisType.Auto,) * 4)
    layer = KimiDeltaAttention(KDASpec.of(cfg, mesh), rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(lambda x: layer(x, None, seg))(x))
        got, got_grads = out_and_grad(layer, x)
    assert "shard_map" in jaxpr
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_bf16_compute_close_to_fp32():
    x = _inputs(6)
    outs = []
    for dtype in ("float32", "bfloat16"):
        layer = KimiDeltaAttention(KDASpec.of(_cfg(dtype=dtype)), rngs=nnx.Rngs(0))
        outs.append(_call(layer, jnp.asarray(x)))
    assert outs[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(outs[1], np.float32), outs[0], rtol=0,
                               atol=3e-2 * float(jnp.abs(outs[0]).max()))
