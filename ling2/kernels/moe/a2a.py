"""The expert-parallel token exchange as a ragged all-to-all: each device sends each peer exactly the rows
routed to that peer's experts, instead of a worst-case-sized buffer per peer (`moe_ep`'s padded form).

Inside `shard_map` over the `expert` axis (n devices). A device's M rows are sorted by expert, so the rows
for peer j are one run [start_j, start_j + count_j). From the all-gathered count matrix C [n, n]
(C[i, j]: rows i sends j), every device derives the same `Plan`: where each run goes in the receiver's
buffer (the receivers' buffers hold their senders' runs one after another, in sender order), and the
reverse, for sending the experts' outputs back. A window of that buffer gives the plans of one round of a
bounded exchange (each receiver gets only the rows landing in its window).

`exchange(x, plan)` moves rows by `jax.lax.ragged_all_to_all`; its VJP is the exchange the other way
(the transpose of moving rows is moving them back; rows nobody sent are zero both ways), written as a
custom VJP so it never depends on JAX's own transpose rule. `emulated=True` performs the same exchange
with a padded `all_to_all` and row gathers: the same offsets and the same results, on platforms that
cannot run ragged all-to-all (XLA:CPU), which is how the index arithmetic is tested on CPU.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Plan(NamedTuple):
    """One direction of the exchange, all [n] int32 (this device's view)."""
    input_offsets: jax.Array  # where my run for peer j starts in my operand
    send_sizes: jax.Array  # rows I send peer j
    output_offsets: jax.Array  # where my run lands in peer j's buffer
    recv_sizes: jax.Array  # rows I receive from peer i
    recv_offsets: jax.Array  # where peer i's run lands in my buffer


def _exclusive_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis) - a


def count_matrix(count_n, axis_name: str):
    """C [n senders, n receivers] from each device's per-peer send counts [n]: the same on every device."""
    return jax.lax.all_gather(count_n.astype(jnp.int32), axis_name)


def plans(C, me, window: tuple | None = None) -> tuple[Plan, Plan]:
    """(dispatch, combine) plans of device `me` from the count matrix C (`count_matrix`).

    `window` (lo, rows): only the rows that land in [lo, lo + rows) of each receiver's full buffer, placed
    at their offsets minus lo: one round of an exchange whose receive buffers hold `rows` rows."""
    start_C = _exclusive_cumsum(C, 1)  # sender i's run for j starts at start_C[i, j] in i's operand
    land_C = _exclusive_cumsum(C, 0)  # sender i's run lands at land_C[i, j] in j's buffer
    if window is not None:
        lo, rows = window
        first_C = jnp.clip(land_C, lo, lo + rows)
        C = jnp.clip(land_C + C, lo, lo + rows) - first_C
        start_C, land_C = start_C + first_C - land_C, first_C - lo
    dispatch = Plan(start_C[me], C[me], land_C[me], C[:, me], land_C[:, me])
    combine = Plan(land_C[:, me], C[:, me], start_C[:, me], C[me], start_C[me])
    return dispatch, combine


def _emulated(x, out_rows: int, plan: Plan, axis_name: str):
    """ragged_all_to_all's result by a padded all_to_all: [n, cap] slots per peer, cap = the operand's rows."""
    n, R = plan.send_sizes.shape[0], x.shape[0]
    j = jnp.arange(R)
    src = jnp.where(j[None, :] < plan.send_sizes[:, None], plan.input_offsets[:, None] + j[None, :], R)
    send = jnp.take(x, src, axis=0, mode="fill", fill_value=0)  # [n, R, ...]
    got = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=False)  # got[i]: what peer i sent me
    land = jax.lax.all_to_all(plan.output_offsets, axis_name, 0, 0, tiled=True)  # where peer i put it for me
    dest = jnp.where(j[None, :] < plan.recv_sizes[:, None], land[:, None] + j[None, :], out_rows)
    out = jax.lax.full_like(x, 0, shape=(out_rows,) + x.shape[1:])  # varying over x's manual axes, as x
    return out.at[dest.reshape(-1)].set(got.reshape((n * R,) + x.shape[1:]), mode="drop")


def _move(x, out_rows: int, plan: Plan, axis_name: str, emulated: bool):
    if emulated:
        return _emulated(x, out_rows, plan, axis_name)
    out = jax.lax.full_like(x, 0, shape=(out_rows,) + x.shape[1:])
    return jax.lax.ragged_all_to_all(x, out, plan.input_offsets, plan.send_sizes, plan.output_offsets,
                                     plan.recv_sizes, axis_name=axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(1, 4, 5))
def exchange(x, out_rows: int, plan: Plan, back: Plan, axis_name: str, emulated: bool):
    """x's runs moved to their peers by `plan`: [out_rows, ...] (rows nobody wrote are zero). `back` is the
    plan the other way (the second of `plans`' pair when `plan` is the first), used by the VJP."""
    return _move(x, out_rows, plan, axis_name, emulated)


def _exchange_fwd(x, out_rows, plan, back, axis_name, emulated):
    return _move(x, out_rows, plan, axis_name, emulated), (x.shape[0], plan, back)


def _exchange_bwd(out_rows, axis_name, emulated, res, g):
    in_rows, plan, back = res
    zero = lambda p: jax.tree.map(jnp.zeros_like, p)
    return _move(g, in_rows, back, axis_name, emulated), zero(plan), zero(back)


exchange.defvjp(_exchange_fwd, _exchange_bwd)
