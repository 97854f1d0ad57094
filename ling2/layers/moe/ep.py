"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens moved by all-to-all.

Inside `shard_map`, each device holds T local tokens (its rows' positions on its context shard) and E/n experts (n = size of `expert`).
Inside a pipeline stage already manual over `expert` (`ling2.layers.pipeline`) the body runs as is.
With n = 1 (no expert axis) the same body is the per-device grouped matmul of a multi-device
mesh: the weights are gathered whole, the all-to-alls are no-ops, and the grouped matmul runs on
local rows, as a Pallas kernel (megablox) must (XLA cannot partition it).
It sorts its M = T*K assignments by expert, sends each expert shard its rows, runs its experts on
what it received, and sends the results back. Two exchanges (`moe_ep_all_to_all`):

  padded  `all_to_all` of [n, M, D] (dropless, since one shard may receive every row): its own
          transpose, so differentiable on any platform; but every device sends and receives n*M rows
          whatever the routing (the plans: most of a pod's collective bytes and temporaries).
  ragged  `ragged_all_to_all` (ling2.kernels.moe.a2a): each peer gets exactly its rows, into a receive
          buffer of `moe_ep_capacity_factor` x M rows (n*M when <= 0). Where some device would be sent
          more rows than that, the layer's exchange runs in rounds for that step, each filling every
          receiver's buffer at most once (the count decided from the all-gathered counts every device
          holds): never a dropped token, and never a buffer larger than the bound. XLA:CPU cannot run
          ragged all-to-all, so "auto" is padded there and "emulated" runs the ragged path's offsets with
          padded collectives (how CPU tests check it).
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling2.kernels.moe import a2a as moe_a2a
from ling2.layers.moe import experts as X
from ling2.layers import sharding
from ling2.kernels.moe.gmm import gather_rows
from ling2.layers.moe import plan as moe_plan


def expert_axis_size(mesh) -> int:
    return mesh.shape.get("expert", 1) if mesh is not None and not mesh.empty else 1


def batch_axes(mesh, rules, batch: int) -> tuple[str, ...]:
    """Mesh axes of the `activation_batch` rule that shard `batch` (each must divide what is left); axes the
    traced code is manual over (a pipeline's "stage") do not split it further."""
    axes, prod = [], 1
    manual = frozenset(getattr(mesh, "manual_axes", ()))
    for name, mesh_axes in rules:
        if name == "activation_batch":
            for a in mesh_axes or ():
                size = 1 if a in manual else mesh.shape.get(a, 1)
                if size > 1 and batch % (prod * size) == 0:
                    axes.append(a)
                    prod *= size
    return tuple(axes)


def _local(x_TD, experts_TK, weights_TK, w, *, n: int, ffn):
    """Per-device body. w are this shard's experts [E/n, ...]."""
    T, K = experts_TK.shape
    M, e_loc = T * K, w[0].shape[0]
    order_M, inv_M, gs_E = X.sort_by_expert(experts_TK, e_loc * n)
    x_MD = gather_rows(x_TD, order_M // K, inv_M, K)
    # Rows for shard s are sorted rows [start_s, start_s + count_s): pad each into M slots.
    count_n = gs_E.reshape(n, e_loc).sum(1)
    start_n = jnp.cumsum(count_n) - count_n
    j = jnp.arange(M)
    valid_nM = j[None, :] < count_n[:, None]
    src_nM = jnp.where(valid_nM, start_n[:, None] + j[None, :], M)
    send_nMD = jnp.take(x_MD, src_nM, axis=0, mode="fill", fill_value=0)
    local_e = experts_TK.reshape(-1)[order_M] % e_loc
    ids_nM = jnp.where(valid_nM, jnp.take(local_e, src_nM, mode="fill", fill_value=0), e_loc)

    recv_nMD = jax.lax.all_to_all(send_nMD, "expert", 0, 0, tiled=False)
    rids = jax.lax.all_to_all(ids_nM, "expert", 0, 0, tiled=False).reshape(-1)

    # Local grouped matmul over what arrived; padding rows (id e_loc) sort last and stay zero.
    lorder = jnp.argsort(rids, stable=True)
    linv = X.invert(lorder)
    lgs = jnp.bincount(rids, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    y_sorted = ffn(gather_rows(recv_nMD.reshape(n * M, -1), lorder, linv, 1), lgs, w)
    y_nMD = gather_rows(y_sorted, linv, lorder, 1).reshape(n, M, -1)

    back_nMD = jax.lax.all_to_all(y_nMD, "expert", 0, 0, tiled=False)
    r = jnp.arange(M)
    shard_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(count_n), r, side="right"), n - 1)
    y_MD = back_nMD[shard_M, r - start_n[shard_M]]
    y_TKD = gather_rows(y_MD, inv_M, order_M, 1).reshape(T, K, -1)
    return X.combine(y_TKD, weights_TK, x_TD.dtype)


def recv_rows(M: int, n: int, capacity_factor: float) -> int:
    """Rows of the ragged exchange's receive buffer: factor x the balanced share M (a multiple of 8), at most
    n*M (every row of every peer); n*M when the factor is <= 0."""
    if capacity_factor <= 0:
        return n * M
    return min(n * M, -(-math.ceil(capacity_factor * M) // 8) * 8)


def _local_ragged(x_TD, experts_TK, weights_TK, w, *, n: int, ffn, capacity_factor: float,
                  emulated: bool):
    """Per-device body with the ragged exchange (`_local`'s contract) into receive buffers of R rows
    (`recv_rows`). With R < n*M a receiver may be sent more than R rows: the exchange then runs in rounds
    (`_in_rounds`)."""
    T, K = experts_TK.shape
    M, e_loc = T * K, w[0].shape[0]
    R = recv_rows(M, n, capacity_factor)
    order_M, inv_M, gs_E = X.sort_by_expert(experts_TK, e_loc * n)
    x_MD = gather_rows(x_TD, order_M // K, inv_M, K)
    sent = jax.lax.all_gather(gs_E.reshape(n, e_loc), "expert")  # [sender, receiver, receiver's expert]: rows
    one = partial(_round, R=R, ffn=ffn, emulated=emulated)
    y_MD = one(x_MD, w, sent, 0) if R >= n * M else _in_rounds(x_MD, w, sent, one, R)
    y_TKD = gather_rows(y_MD, inv_M, order_M, 1).reshape(T, K, -1)
    return X.combine(y_TKD, weights_TK, x_TD.dtype)


def _round(x_MD, w, sent, r, *, R: int, ffn, emulated: bool):
    """Round r of the exchange: the rows that land in [r*R, (r+1)*R) of each receiver's full buffer go out,
    through the receiver's experts and back. [M, D], zero on the rows of other rounds."""
    e_loc = sent.shape[2]
    me = jax.lax.axis_index("expert")
    dispatch, combine = moe_a2a.plans(sent.sum(2), me, window=(r * R, R))
    recv_RD = moe_a2a.exchange(x_MD, R, dispatch, combine, "expert", emulated)
    # The full buffer holds sender 0's run (sorted by my experts), then sender 1's, ...: segment (i, e) ends
    # at the running sum of mine[i, e]; rows past the last segment are padding (id e_loc, sorted last).
    mine = sent[:, me].reshape(-1)
    at_R = r * R + jnp.arange(R)
    seg_R = jnp.searchsorted(jnp.cumsum(mine), at_R, side="right")
    e_R = jnp.where(at_R < mine.sum(), seg_R % e_loc, e_loc)
    lorder = jnp.argsort(e_R, stable=True)
    linv = X.invert(lorder)
    gs = jnp.bincount(e_R, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    y_sorted = ffn(gather_rows(recv_RD, lorder, linv, 1), gs, w)
    return moe_a2a.exchange(gather_rows(y_sorted, linv, lorder, 1), x_MD.shape[0], combine, dispatch, "expert",
                            emulated)


def _in_rounds(x_MD, w, sent, one, R: int):
    """The sum of `one`'s rounds, as many as the most loaded receiver needs (the same on every device, from
    the all-gathered counts): one when no receiver gets more than R rows, the usual case, which runs without
    a loop.

    A loop of data-dependent length has no reverse-mode rule, so this is a custom VJP whose backward runs
    the same rounds, each recomputing its forward and differentiating it; only R-row buffers are ever live.
    Several rounds sum their weight gradients in the weights' dtype; one round's are the single pass's.
    The one-round branch is the conditional's first, the one `hlo_traffic` counts."""
    rounds = lambda sent: -(-jnp.max(sent.sum((0, 2))) // R)

    def forward(x, w, sent):
        loop = lambda: jax.lax.fori_loop(0, rounds(sent), lambda r, y: y + one(x, w, sent, r), jnp.zeros_like(x))
        return jax.lax.cond(rounds(sent) > 1, loop, lambda: one(x, w, sent, 0))

    def backward(x, w, sent, ct):
        grads = lambda r: jax.vjp(lambda x, w: one(x, w, sent, r), x, w)[1](ct)
        add = lambda r, acc: jax.tree.map(jnp.add, acc, grads(r))
        zeros = jax.tree.map(jnp.zeros_like, (x, w))
        return jax.lax.cond(rounds(sent) > 1, lambda: jax.lax.fori_loop(0, rounds(sent), add, zeros), lambda: grads(0))

    rows = jax.custom_vjp(forward)
    rows.defvjp(lambda x, w, sent: (forward(x, w, sent), (x, w, sent)), lambda res, ct: (*backward(*res, ct), None))
    return rows(x_MD, tuple(w), sent)


def dropless_ep(x_BSD, experts_BSK, weights_BSK, w, *, mesh, rules, plans: dict, q=None, capacity_factor: float = 0.0):
    """Routed output [B, S, D]; equals `moe_experts.dropless` on one device (same sums per token). `plans`:
    the MoE plan per platform (`ling2.layers.moe.plan.plans`: the exchange and the grouped matmul); `q`: FP8
    GEMMs (ling2.kernels.fp8)."""
    n = expert_axis_size(mesh)
    E = w[0].shape[0]
    if E % n:
        raise ValueError(f"num_experts={E} is not divisible by the expert mesh axis ({n})")
    axes = batch_axes(mesh, rules, x_BSD.shape[0])
    within = n > 1 and "expert" in getattr(mesh, "manual_axes", ())  # a pipeline's rows: already per device
    if n > 1 and not within and "expert" not in axes:
        raise ValueError(f"expert parallelism needs the batch ({x_BSD.shape[0]}) sharded over 'expert' by the "
                         f"activation_batch rule; it shards over {axes}")

    ffn = partial(moe_plan.grouped_ffn, plans, q=q)
    local = {"padded": partial(_local, n=n, ffn=ffn),
             "ragged": partial(_local_ragged, n=n, ffn=ffn, capacity_factor=capacity_factor, emulated=False),
             "emulated": partial(_local_ragged, n=n, ffn=ffn, capacity_factor=capacity_factor, emulated=True)}

    def body(x, e, g, wg, wu, wd):
        b, s, _ = x.shape
        args = (x.reshape(b * s, -1), e.reshape(b * s, -1), g.reshape(b * s, -1), (wg, wu, wd))
        y = moe_plan.per_platform(plans, lambda plan: local[plan.exchange], *args, fields=("exchange",))
        return y.reshape(x.shape)

    # Rows and positions split as activations (a context axis splits positions); _local needs exactly the
    # expert axis's shards of the weights.
    if within:
        return body(x_BSD, experts_BSK, weights_BSK, *w)
    BSD, EXP = ("activation_batch", "activation_length", None), P("expert")
    f = sharding.shard_map_by_names(body, (BSD, BSD, BSD, EXP, EXP, EXP), BSD, rules, mesh=mesh)
    return f(x_BSD, experts_BSK, weights_BSK, *w)
