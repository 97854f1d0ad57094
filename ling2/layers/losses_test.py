"""Cross-entropy sums.

References: a float64 numpy log-softmax and its hand-written gradient (softmax - one-hot),
both written out here; for the vocab-blocked loss also today's path (full logits from the
real LMHead / Embed.attend through `cross_entropy_sums`, differentiated by JAX).
The sharded test runs on 8 fake CPU devices (BUILD: devices = 8).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ling2.config import load_config
from ling2.config.schema import MESH_AXES
from ling2.layers import losses, sharding
from ling2.layers.embed import Embed, LMHead, logits_einsum
from ling2.config.specs import EmbedSpec, RunSpec

F32 = jnp.float32


def numpy_sums_and_grads(x_BTE, k_EV, tgt_BT, w_BT):
    """float64 (ce, n, hits) and d ce / d (x, k, w), with jnp.argmax's first-max rule (np.argmax's too)."""
    x, k, w = (np.asarray(a, np.float64) for a in (x_BTE, k_EV, w_BT))
    z = x @ k
    zmax = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - zmax).sum(-1)) + zmax[..., 0]
    tgt = np.take_along_axis(z, tgt_BT[..., None], -1)[..., 0]
    hits = (z.argmax(-1) == tgt_BT)
    dz = (np.exp(z - lse[..., None]) - np.eye(k.shape[1])[tgt_BT]) * w[..., None]
    sums = ((lse - tgt) * w).sum(), w.sum(), (hits * w).sum()
    return sums, (dz @ k.T, np.einsum("bte,btv->ev", x, dz), lse - tgt)


def case(seed, B=2, T=6, E=16, V=37, dtype=np.float32):
    r = np.random.default_rng(seed)
    x = r.normal(size=(B, T, E)).astype(dtype)
    k = (r.normal(size=(E, V)) * 0.5).astype(np.float32)
    tgt = r.integers(0, V, (B, T)).astype(np.int32)
    w = r.integers(0, 3, (B, T)).astype(np.float32)
    w[0, :2] = 0  # zero weights
    return x, k, tgt, w


def full_loss(x, k, tgt, w, tied=False):
    """Today's path: full logits, then cross_entropy_sums."""
    return losses.cross_entropy_sums(losses.head_logits(x, k, tied=tied), tgt, w)


def blocked_loss(x, k, tgt, w, n, tied=False, shards=1, run=None):
    return losses.head_cross_entropy_sums(x, k, tgt, w, num_blocks=n, vocab_shards=shards, tied=tied, run=run)


def grads(loss, x, k, w):
    """d/d(x, k, w) of ce + 0.5 * n + 0.25 * hits, so every output's cotangent is exercised."""
    return jax.jit(jax.grad(lambda x, k, w: (lambda s: s[0] + 0.5 * s[1] + 0.25 * s[2])(loss(x, k, w)),
                            argnums=(0, 1, 2)))(x, k, w)


def close(a, b, rtol):
    """Elementwise, relative to the array's largest magnitude."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-30))


def test_cross_entropy_sums_against_numpy():
    x, k, tgt, w = case(1)
    (ce, n, hits), _ = numpy_sums_and_grads(x, k, tgt, w)
    got = losses.cross_entropy_sums(jnp.asarray(x) @ jnp.asarray(k), jnp.asarray(tgt), jnp.asarray(w))
    np.testing.assert_allclose(float(got[0]), ce, rtol=1e-5)
    assert float(got[1]) == n and float(got[2]) == hits


# (V, vocab_shards, num_blocks, tied): blocks of 10 with the last one overlapping (37 = 3 * 10 + 7),
# of 8 (5 blocks, 40 > 37), single columns, one block; two shards of 18 in 4 blocks of 5; 300 ids
# in blocks rounded up to 128 columns (3 blocks of 128, the last overlapping), shards of 150 / 100.
PLANS = [(37, 1, 4, False), (37, 1, 4, True), (37, 1, 5, False), (37, 1, 37, True), (37, 1, 1, False),
         (36, 2, 4, False), (36, 2, 4, True), (300, 1, 3, False), (300, 2, 1, True), (300, 3, 7, False)]


@pytest.mark.parametrize("V,shards,n,tied", PLANS)
def test_blocked_equals_full_logits_fp32(V, shards, n, tied):
    x, k, tgt, w = map(jnp.asarray, case(2, V=V))
    kk = k.T if tied else k
    (ce, cnt, hits), (dx, dk, dw) = numpy_sums_and_grads(x, k, tgt, w)
    got = jax.jit(lambda x, k, w: blocked_loss(x, k, tgt, w, n, tied, shards))(x, kk, w)
    today = jax.jit(lambda x, k, w: full_loss(x, k, tgt, w, tied))(x, kk, w)
    np.testing.assert_allclose(float(got[0]), float(today[0]), rtol=1e-6)
    np.testing.assert_allclose(float(got[0]), ce, rtol=1e-6)
    assert float(got[1]) == float(today[1]) == cnt and float(got[2]) == float(today[2]) == hits

    g_new = grads(lambda x, k, w: blocked_loss(x, k, tgt, w, n, tied, shards), x, kk, w)
    g_today = grads(lambda x, k, w: full_loss(x, k, tgt, w, tied), x, kk, w)
    hit_w = 0.25 * (np.asarray(x @ k).argmax(-1) == np.asarray(tgt))
    for a, b in zip(g_new, g_today):
        close(a, b, 1e-6)
    close(g_new[0], dx, 1e-5)
    close(g_new[1], dk.T if tied else dk, 1e-5)
    close(g_new[2], dw + 0.5 + hit_w, 1e-5)
    assert g_new[1].shape == kk.shape and g_new[1].dtype == kk.dtype


def test_plan_of_the_real_vocab():
    """157184 ids in 16 blocks: 9824 rounds up to 9856 (77 x 128); the 16th block starts at 157184 - 9856."""
    p = losses._Plan.make(157184, 1, 16, False)
    assert (p.S, p.c, p.n, int(p.start(15))) == (157184, 9856, 16, 147328)
    p = losses._Plan.make(157184, 4, 16, False)
    assert (p.S, p.c, p.n, int(p.start(15))) == (39296, 2560, 16, 36736)


def test_argmax_ties_take_the_lowest_id():
    """Exact ties (integer logits) in 2 shards of 8 ids, blocks of 4: block 0 = ids 0-3 and 8-11, block 1 =
    4-7 and 12-15. Ties {1, 9} fall in one block, {3, 5} in blocks 0 then 1, {4, 8}: the higher id first."""
    E, V = 3, 16
    k = np.zeros((E, V), np.float32)
    for row, ids in enumerate(([1, 9], [3, 5], [4, 8])):
        k[row, ids] = 5.0
    x = np.zeros((1, 6, E), np.float32)
    for t in range(6):
        x[0, t, t // 2] = 1.0
    tgt = np.array([[1, 9, 3, 5, 4, 8]], np.int32)
    w = np.ones((1, 6), np.float32)
    assert list((x @ k).argmax(-1)[0]) == [1, 1, 3, 3, 4, 4]  # numpy's first-max rule
    args = tuple(map(jnp.asarray, (x, k, tgt, w)))
    for shards, n in ((2, 2), (1, 4), (1, 1)):
        assert float(blocked_loss(*args, n, shards=shards)[2]) == 3.0
    assert float(full_loss(*args)[2]) == 3.0


def lm_cfg(E, V, dtype, float32_logits):
    return EmbedSpec(init_std=0.3, emb_dim=E, vocab_size=V, weight_dtype="float32", dtype=dtype,
                     float32_logits=float32_logits, normalization_layer_epsilon=1e-6,
                     run=RunSpec.of(load_config()))


@pytest.mark.parametrize("float32_logits", [True, False])
@pytest.mark.parametrize("tied", [False, True])
def test_bf16_compute_matches_lm_head(float32_logits, tied):
    """bf16 hidden and compute, fp32 weights, fp32 (or bf16) logits: the real LMHead / Embed.attend."""
    E, V = 32, 300
    x, _, tgt, w = map(jnp.asarray, case(3, E=E, V=V))
    x = x.astype(jnp.bfloat16)
    cfg = lm_cfg(E, V, "bfloat16", float32_logits)
    ld = F32 if float32_logits else jnp.bfloat16
    head = Embed(cfg, rngs=nnx.Rngs(0)) if tied else LMHead(cfg, rngs=nnx.Rngs(0))
    kernel = head.embedding if tied else head.kernel

    def today(m, x):
        logits = m.attend(x, ld) if tied else m(x)
        return losses.cross_entropy_sums(logits.astype(F32), tgt, w)[0]

    def blocked(m, x):
        kk = m.embedding[...] if tied else m.kernel[...]
        return losses.head_cross_entropy_sums(x, kk, tgt, w, num_blocks=7, compute_dtype=jnp.bfloat16,
                                              logits_dtype=ld, tied=tied)[0]

    (l0, (gm0, gx0)), (l1, (gm1, gx1)) = (nnx.jit(nnx.value_and_grad(f, argnums=(0, 1)))(head, x)
                                          for f in (today, blocked))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    gk0 = (gm0.embedding if tied else gm0.kernel)[...]
    gk1 = (gm1.embedding if tied else gm1.kernel)[...]
    assert gx1.dtype == jnp.bfloat16 and gk1.dtype == kernel[...].dtype
    for a, b in ((gx1, gx0), (gk1, gk0)):  # rounded to bf16 once, from sums accumulated in another order
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.abs(a - b) <= 2.0 ** -7 * np.abs(b)), "more than one bf16 ulp apart"
        assert np.mean(a == b) > 0.95


def test_zero_blocks_is_the_full_path_and_errors():
    x, k, tgt, w = map(jnp.asarray, case(4))
    assert [float(a) for a in blocked_loss(x, k, tgt, w, 0)] == [float(a) for a in full_loss(x, k, tgt, w)]
    with pytest.raises(ValueError, match="num_blocks"):
        blocked_loss(x, k, tgt, w, 38)
    with pytest.raises(ValueError, match="vocab_shards"):
        blocked_loss(x, k, tgt, w, 4, shards=2)
    with pytest.raises(ValueError, match="kernel"):
        blocked_loss(x, k.T, tgt, w, 4)
    with pytest.raises(ValueError, match="targets"):
        blocked_loss(x, k, tgt[:, :3], w, 4)


def test_under_remat_and_scan():
    """Inside jax.checkpoint and a lax.scan over micro-batches (as the train step runs it)."""
    x, k, tgt, w = map(jnp.asarray, case(5, B=4))

    def total(loss):
        def micro(acc, mb):
            return acc + jax.checkpoint(lambda x, k: loss(x, k, mb[1], mb[2])[0])(mb[0], k), None
        mbs = tuple(a.reshape(2, 2, *a.shape[1:]) for a in (x, tgt, w))
        return jax.jit(jax.value_and_grad(lambda k: jax.lax.scan(micro, 0.0, mbs)[0]))(k)

    (v0, g0), (v1, g1) = total(full_loss), total(lambda x, k, t, w: blocked_loss(x, k, t, w, 5))
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    close(g1, g0, 1e-6)


@pytest.mark.parametrize("mesh_sizes", [dict(data=2, tensor=4), dict(fsdp=2, expert=2, tensor=2)])
def test_sharded_equals_single_device(mesh_sizes):
    """Vocab-sharded kernel (tensor axis) and batch-sharded tokens under jit: same sums and gradients,
    and with vocab_shards = the tensor size the kernel's gradient keeps the kernel's vocab sharding."""
    assert jax.device_count() == 8
    cfg = load_config()
    shape = tuple(mesh_sizes.get(a, 1) for a in MESH_AXES)
    mesh = Mesh(np.asarray(jax.devices()).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    rules = sharding.rules_dict(cfg.logical_axis_rules)
    x, k, tgt, w = map(jnp.asarray, case(6, B=4, T=8, E=32, V=160))

    def step(x, k, tgt, w, n, shards, run=None):
        return jax.value_and_grad(lambda x, k: (lambda s: s[0] + s[2])(blocked_loss(x, k, tgt, w, n, shards=shards,
                                                                                    run=run)), argnums=(0, 1))(x, k)

    def put(a, names):
        return jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(names, a.shape, rules, mesh)))

    batch = ("activation_batch", "activation_length")
    args = (put(x, batch + ("activation_embed",)), put(k, ("embed", "vocab")), put(tgt, batch), put(w, batch))
    assert args[1].sharding.spec == P(None, "tensor") or args[1].sharding.spec == P("fsdp", "tensor")
    t = mesh.shape["tensor"]
    v1, (gx1, gk1) = jax.jit(step, static_argnums=(4, 5))(x, k, tgt, w, 0, 1)
    for n, shards in ((3, t), (5, 1)):
        with jax.set_mesh(mesh):
            v8, (gx8, gk8) = jax.jit(step, static_argnums=(4, 5, 6))(*args, n, shards, RunSpec.of(cfg, mesh))
        np.testing.assert_allclose(float(v8), float(v1), rtol=1e-6)
        close(gx8, gx1, 1e-6)
        close(gk8, gk1, 1e-6)
        if shards == t:
            assert gk8.sharding.spec[1] == "tensor"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logits_backward_rounds_the_cotangent_to_the_compute_dtype(dtype):
    """logits_einsum's VJP against numpy (float64): the operands' gradients are the products of the logits'
    cotangent rounded to the operands' dtype (bf16) or kept (fp32: plain autodiff), accumulated in fp32."""
    r = np.random.default_rng(7)
    x = jnp.asarray(r.standard_normal((2, 5, 16)), dtype)
    w = jnp.asarray(r.standard_normal((16, 40)), dtype)
    dz = jnp.asarray(r.standard_normal((2, 5, 40)), F32)
    y, vjp = jax.vjp(lambda x, w: logits_einsum("bte,ev->btv", x, w, F32), x, w)
    dx, dw = vjp(dz)
    assert y.dtype == F32 and dx.dtype == dtype and dw.dtype == dtype
    dzr = np.asarray(dz.astype(dtype), np.float64)
    xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -8
    for got, want in ((dx, np.einsum("btv,ev->bte", dzr, wn)), (dw, np.einsum("bte,btv->ev", xn, dzr))):
        got = np.asarray(got, np.float64)
        assert np.all(np.abs(got - want) <= tol * np.abs(want) + 1e-5), np.abs(got - want).max()
