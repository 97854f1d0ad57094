"""Attention layers with the sequence split over a `context` mesh axis (8 fake CPU devices) against the same
layer on one device: outputs and the gradients of every weight and of the input.

Reference: the unsharded layer with attention_kernel=dot_product (MLA; itself checked against a float64
formula and transformers elsewhere) or its chunked kernel (KDA). Packed documents start inside shards and
exactly on shard edges, and one spans three shards."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from ling2.config import load_config
from ling2.config.schema import MESH_AXES
from ling2.config.specs import KDASpec, MLASpec
from ling2.layers.attention import kda as attention_kda
from ling2.layers.attention import mla as attention_mla

T = 128


def mesh(**sizes):
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    devices = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def inputs(E, seed=0, T=T):
    r = np.random.default_rng(seed)
    x = r.normal(size=(2, T, E)).astype(np.float32)
    seg = np.ones((2, T), np.int32)
    u = T // 128
    seg[0, 5 * u:] += 1
    seg[0, 32 * u:] += 1  # on an edge of 4 shards (and of 8)
    seg[0, 40 * u:] += 1  # spans shards 2..7 of 8
    seg[1, 64 * u:] += 1  # every split's middle edge
    seg[1, 70 * u:] += 1
    start = np.maximum.accumulate(np.where(np.diff(seg, prepend=0, axis=1) != 0, np.arange(T), 0), axis=1)
    return jnp.asarray(x), jnp.asarray(np.arange(T) - start, jnp.int32), jnp.asarray(seg)


def out_and_grads(layer, x, pos, seg):
    def loss(m, x):
        o = m(x, pos, seg, layer_index=0)
        return jnp.sum(o * jnp.cos(o)), o

    (_, o), (g_m, g_x) = jax.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(layer, x)
    return np.asarray(o), {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(g_m))}, np.asarray(g_x)


def compare(ref, got, rtol):
    np.testing.assert_allclose(got[0], ref[0], rtol=rtol, atol=rtol * np.abs(ref[0]).max())
    for p, g in ref[1].items():
        np.testing.assert_allclose(got[1][p], g, rtol=rtol, atol=rtol * np.abs(g).max(), err_msg=str(p))
    np.testing.assert_allclose(got[2], ref[2], rtol=rtol, atol=rtol * np.abs(ref[2]).max())


def mla_cfg(T=T, **kw):
    return load_config(model_name="ling2-tiny", base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=4,
                       head_dim=16, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=8,
                       v_head_dim=5, dtype="float32", init_std=0.2, max_target_length=T, gla_chunk_size=8,
                       max_position_embeddings=max(T, 1024), **{"attention_block_size": 16, **kw})


@pytest.mark.parametrize("kernel", ["dot_product", "blocked", "cudnn", "flash"])
@pytest.mark.parametrize("sizes", [dict(context=2), dict(context=8), dict(context=4, tensor=2)],
                         ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_mla_under_context_parallelism_equals_one_device(kernel, sizes):
    """flash (splash attention, interpreted on CPU) takes blocks of 128 queries, and each shard holds two chunks
    of the balanced layout: 256 per shard."""
    t = 256 * sizes["context"] if kernel == "flash" else T
    cfg = mla_cfg(t, attention_kernel="dot_product")
    x, pos, seg = inputs(cfg.base_emb_dim, T=t)
    ref = out_and_grads(attention_mla.MLA(MLASpec.of(cfg), rngs=nnx.Rngs(0)), x, pos, seg)
    cfg = mla_cfg(t, attention_kernel=kernel, attention_block_size=128 if kernel == "flash" else 16)
    m = mesh(**sizes)
    layer = attention_mla.MLA(MLASpec.of(cfg, m), rngs=nnx.Rngs(0))
    with jax.set_mesh(m):
        got = out_and_grads(layer, x, pos, seg)
    compare(ref, got, 2e-5)


def test_mla_context_gathers_latents_not_keys():
    """Under context parallelism the all-gather along the context axis moves the latents (kv_lora + rope = 18
    values per token here), never the per-head keys and values (4 heads x (14 + 5))."""
    cfg = mla_cfg(attention_kernel="blocked")
    x, pos, seg = inputs(cfg.base_emb_dim)
    m = mesh(context=8)
    layer = attention_mla.MLA(MLASpec.of(cfg, m), rngs=nnx.Rngs(0))
    with jax.set_mesh(m):
        hlo = jax.jit(lambda m, x: m(x, pos, seg, layer_index=0)).lower(layer, x).compile().as_text()
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line or "all-gather-start(" in line]
    assert gathers
    assert all("f32[2,128,4," not in line for line in gathers), gathers


def test_kda_layer_under_context_parallelism_equals_one_device():
    """The short conv reads the previous shard's last K-1 rows (zeroed at a document start) and the state
    crosses shard edges (`kda_cp`)."""
    cfg = load_config(model_name="ling3-tiny", base_emb_dim=32, max_target_length=T, kda_chunk_size=16,
                      init_std=0.2)
    x, pos, seg = inputs(cfg.base_emb_dim, seed=1)
    ref = out_and_grads(attention_kda.KimiDeltaAttention(KDASpec.of(cfg), rngs=nnx.Rngs(0)), x, pos, seg)
    for sizes in (dict(context=4), dict(context=8), dict(context=2, tensor=2)):
        m = mesh(**sizes)
        layer = attention_kda.KimiDeltaAttention(KDASpec.of(cfg, m), rngs=nnx.Rngs(0))
        with jax.set_mesh(m):
            got = out_and_grads(layer, x, pos, seg)
        compare(ref, got, 2e-5)
