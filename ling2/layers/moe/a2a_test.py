"""The ragged expert-parallel exchange on 8 fake CPU devices.

XLA:CPU cannot run `ragged_all_to_all`, so on CPU the exchange runs `emulated` (the same plans, moved by
padded collectives); that the real op lowers, forward and backward, with the plans built here is checked
through the real TPU compiler in `tests/moe_ep_tpu_compile_test.py`.

Reference: numpy's reading of ragged_all_to_all's contract (each sender's run for peer j, written at the
offset the sender names, into j's zeroed buffer) for the exchange and its transpose. The MoE layer with the
ragged exchange is checked against one device in moe_ep_test.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ling2.kernels.moe import a2a as moe_a2a
from ling2.config import load_config
from ling2.config.specs import MoESpec
from ling2.layers.moe import ep as moe_ep
from ling2.layers.moe import plan as moe_plan

N, ROWS, OUT, D = 4, 12, 30, 3


def counts_and_rows():
    rng = np.random.default_rng(0)
    counts = np.zeros((N, N), np.int32)  # counts[i, j]: rows device i sends device j (sum <= ROWS)
    for i in range(N):
        c = rng.multinomial(int(rng.integers(4, ROWS + 1)), np.ones(N) / N)
        counts[i] = c
    counts[2] = [0, ROWS, 0, 0]  # one device sends everything to one peer, nothing to the others
    x = rng.normal(size=(N, ROWS, D)).astype(np.float32)
    return counts, x


def runs(counts):
    """(sender i, receiver j, sender's rows, receiver's rows) of every run: j's buffer holds its senders' runs
    one after another, in sender order."""
    for j in range(N):
        at = 0
        for i in range(N):
            start, c = counts[i, :j].sum(), counts[i, j]
            yield i, j, slice(start, start + c), slice(at, at + c)
            at += c


def numpy_exchange(counts, x, out_rows=OUT):
    """ragged_all_to_all's result: each run at its place, zeros after."""
    out = np.zeros((N, out_rows, D), np.float32)
    for i, j, src, dst in runs(counts):
        out[j, dst] = x[i, src]
    return out


def run_exchange(counts, x, ct):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("expert",))

    def body(count_n, x, ct):
        dispatch, combine = moe_a2a.plans(moe_a2a.count_matrix(count_n[0], "expert"), jax.lax.axis_index("expert"))
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
    for i, j, src, dst in runs(counts):
        want[i, src] = ct[j, dst]
    np.testing.assert_array_equal(dx, want)


def test_plans_combine_is_dispatch_reversed():
    counts, _ = counts_and_rows()
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("expert",))

    def body(count_n):
        d, c = moe_a2a.plans(moe_a2a.count_matrix(count_n[0], "expert"), jax.lax.axis_index("expert"))
        return jnp.stack([*d, *c])[None]

    got = np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(counts))
    for me in range(N):
        d, c = got[me, :5], got[me, 5:]
        np.testing.assert_array_equal(d[1], counts[me])  # send sizes
        np.testing.assert_array_equal(d[3], counts[:, me])  # receive sizes
        np.testing.assert_array_equal(c[1], d[3])  # combine sends back what dispatch received ...
        np.testing.assert_array_equal(c[0], d[4])  # ... from where it landed ...
        np.testing.assert_array_equal(c[3], d[1])  # ... and each peer gets back what it sent


@pytest.mark.parametrize("rows", [5, 8, 13])
def test_windowed_plans_split_the_exchange_into_rounds(rows):
    """Round r's plans (window [r*rows, (r+1)*rows) of every receiver's buffer) move exactly the rows that land
    there, to their place minus r*rows; its combine plan brings each back to the row it came from. Over the
    rounds every sent row goes out and comes back once."""
    counts, x = counts_and_rows()
    full = numpy_exchange(counts, x, N * ROWS)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:N]), ("expert",))

    def body(count_n, x, r):
        d, c = moe_a2a.plans(moe_a2a.count_matrix(count_n[0], "expert"), jax.lax.axis_index("expert"),
                             window=(r * rows, rows))
        y = moe_a2a.exchange(x[0], rows, d, c, "expert", True)
        return y[None], moe_a2a.exchange(y, ROWS, c, d, "expert", True)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P("expert"), P()),
                              out_specs=(P("expert"), P("expert"))))
    rounds = -(-counts.sum(0).max() // rows)
    returned = np.zeros_like(x)
    for r in range(rounds):
        y, back = map(np.asarray, f(jnp.asarray(counts), jnp.asarray(x), jnp.int32(r)))
        np.testing.assert_array_equal(y, full[:, r * rows:(r + 1) * rows])
        for i, j, src, dst in runs(counts):
            landed = np.arange(dst.start, dst.stop)
            mine = (landed >= r * rows) & (landed < (r + 1) * rows)
            want = np.where(mine[:, None], x[i, src], 0)
            np.testing.assert_array_equal(back[i, src], want)
        returned += back
    sent = np.zeros((N, ROWS), bool)
    for i, j, src, dst in runs(counts):
        sent[i, src] = True
    np.testing.assert_array_equal(returned, np.where(sent[..., None], x, 0))
    assert rounds > 1


def test_recv_rows():
    assert moe_ep.recv_rows(1000, 8, 0.0) == 8000
    assert moe_ep.recv_rows(1000, 8, 1.25) == 1256  # a multiple of 8
    assert moe_ep.recv_rows(1000, 2, 4.0) == 2000  # never more than every row
    with pytest.raises(ValueError, match="moe_ep_all_to_all"):
        spec = MoESpec.of(load_config(model_name="ling2-tiny"))
        spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, moe_ep_all_to_all="fast"))
        moe_plan.moe_plan(spec, {"data": 2, "expert": 4}, "cpu", tokens=4096, model_dim=128)
