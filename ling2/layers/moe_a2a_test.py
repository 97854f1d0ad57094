"""The ragged expert-parallel exchange on 8 fake CPU devices.

XLA:CPU cannot run `ragged_all_to_all`, so on CPU the exchange runs `emulated` (the same plans, moved by
padded collectives); that the real op lowers, forward and backward, with the plans built here is checked
through the real TPU compiler in `moe_tpu_compile_test`.

References: numpy's reading of ragged_all_to_all's contract (each sender's run for peer j, written at the
offset the sender names, into j's zeroed buffer) for the exchange and its transpose; the single-device
dropless MoE layer (itself checked against a float64 numpy loop in moe_test.py) for the layer, forward and
gradients, with the receive bound roomy (ragged) and too tight (the padded fallback)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ling2.config import load_config
from ling2.config.specs import MoESpec
from ling2.layers import moe_a2a, moe_ep
from ling2.layers.moe import MoE

N, ROWS, OUT, D = 4, 12, 30, 3


def make_mesh(data, expert):
    devices = np.asarray(jax.devices()[: data * expert]).reshape(data, 1, expert, 1)
    return jax.sharding.Mesh(devices, ("data", "fsdp", "expert", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 4)


def loss_and_grads(m, x, ct):
    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y * ct) + aux.loss, (y, aux.counts)

    (_, (y, counts)), (gm, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)
    return y, counts, gm, gx


def counts_and_rows():
    rng = np.random.default_rng(0)
    counts = np.zeros((N, N), np.int32)  # counts[i, j]: rows device i sends device j (sum <= ROWS)
    for i in range(N):
        c = rng.multinomial(int(rng.integers(4, ROWS + 1)), np.ones(N) / N)
        counts[i] = c
    counts[2] = [0, ROWS, 0, 0]  # one device sends everything to one peer, nothing to the others
    x = rng.normal(size=(N, ROWS, D)).astype(np.float32)
    return counts, x


def numpy_exchange(counts, x):
    """out[j]: senders' runs for j one after another (sender order), zeros after."""
    out = np.zeros((N, OUT, D), np.float32)
    for j in range(N):
        at = 0
        for i in range(N):
            start = counts[i, :j].sum()
            out[j, at:at + counts[i, j]] = x[i, start:start + counts[i, j]]
            at += counts[i, j]
    return out


def run_exchange(counts, x, ct):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("expert",))

    def body(count_n, x, ct):
        dispatch, combine = moe_a2a.plans(count_n[0], "expert")
        f = lambda x: moe_a2a.exchange(x[0], OUT, dispatch, combine, "expert", True)
        y, vjp = jax.vjp(f, x)
        return y[None], vjp(ct[0])[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=(P("expert"), P("expert")))
    y, dx = jax.jit(f)(jnp.asarray(counts), jnp.asarray(x), jnp.asarray(ct))
    return np.asarray(y), np.asarray(dx)


def test_exchange_and_its_transpose_match_numpy():
    counts, x = counts_and_rows()
    ct = np.random.default_rng(1).normal(size=(N, OUT, D)).astype(np.float32)
    y, dx = run_exchange(counts, x, ct)
    np.testing.assert_array_equal(y, numpy_exchange(counts, x))
    # transpose: each sent row gets the cotangent of the slot it landed in; unsent rows get 0
    want = np.zeros_like(x)
    for j in range(N):
        at = 0
        for i in range(N):
            start = counts[i, :j].sum()
            want[i, start:start + counts[i, j]] = ct[j, at:at + counts[i, j]]
            at += counts[i, j]
    np.testing.assert_array_equal(dx, want)


def test_plans_combine_is_dispatch_reversed():
    counts, _ = counts_and_rows()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("expert",))

    def body(count_n):
        d, c = moe_a2a.plans(count_n[0], "expert")
        return jnp.stack([*d, *c])[None]

    got = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(counts))
    for me in range(N):
        d, c = got[me, :5], got[me, 5:]
        np.testing.assert_array_equal(d[1], counts[me])  # send sizes
        np.testing.assert_array_equal(d[3], counts[:, me])  # receive sizes
        np.testing.assert_array_equal(c[1], d[3])  # combine sends back what dispatch received ...
        np.testing.assert_array_equal(c[0], d[4])  # ... from where it landed ...
        np.testing.assert_array_equal(c[3], d[1])  # ... and each peer gets back what it sent


def test_recv_rows():
    assert moe_ep.recv_rows(1000, 8, 0.0) == 8000
    assert moe_ep.recv_rows(1000, 8, 1.25) == 1256  # a multiple of 8
    assert moe_ep.recv_rows(1000, 2, 4.0) == 2000  # never more than every row
    with pytest.raises(ValueError, match="moe_ep_all_to_all"):
        moe_ep.exchange_kind("fast", 4)


@pytest.mark.parametrize("expert,capacity,skew", [(2, 0.0, 0.0), (4, 0.0, 0.0), (8, 0.0, 0.0), (4, 2.5, 0.0),
                                                  (4, 1.0, 3.0)])
def test_ragged_ep_layer_equals_single_device(expert, capacity, skew, monkeypatch):
    """capacity 0: room for every row; 2.5 (this routing sends one shard 2.4x its share): the ragged exchange
    in a buffer of 0.6 of every row;
    1.0 with a bias that sends most tokens to two experts: the bound overflows and the padded exchange
    runs instead (no token dropped, the same sums)."""
    assert jax.device_count() == 8
    cfg = load_config(model_name="ling2-tiny", load_balance_loss_weight=0.01, moe_z_loss_weight=0.001,
                      moe_ep_all_to_all="emulated", moe_ep_capacity_factor=capacity)
    m = MoE(MoESpec.of(cfg), rngs=nnx.Rngs(0), gmm="tiled")
    bias = jax.random.normal(jax.random.key(3), (cfg.num_experts,)) * 0.05
    m.gate.expert_bias[...] = bias.at[:2].add(skew)
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.base_emb_dim))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    step = nnx.jit(loss_and_grads)
    y1, c1, gm1, gx1 = step(m, x, ct)
    kinds = []
    real = moe_ep._local_ragged
    monkeypatch.setattr(moe_ep, "_local_ragged", lambda *a, **k: kinds.append(k["emulated"]) or real(*a, **k))
    with jax.set_mesh(make_mesh(data=8 // expert, expert=expert)):
        y8, c8, gm8, gx8 = step(m, x, ct)
    assert kinds == [True]  # the ragged body ran (emulated), once per trace
    # rows each expert shard receives against the bound: over it with the skew (most rows to the first
    # shard), within it otherwise (the ragged exchange itself ran)
    per_shard = np.asarray(c1).reshape(expert, -1).sum(1)
    bound = moe_ep.recv_rows(8 * 16 * cfg.num_experts_per_tok // expert, expert, capacity)
    assert (per_shard.max() > bound) == bool(skew), (per_shard, bound)
    np.testing.assert_allclose(y8, y1, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(c8, c1)
    np.testing.assert_allclose(gx8, gx1, rtol=1e-4, atol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(gm8), nnx.to_flat_state(gm1)):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-4, atol=1e-6, err_msg=str(path))
