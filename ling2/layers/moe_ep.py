"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens moved by all-to-all.

Inside `shard_map`, each device holds T local tokens (its rows' positions on its context shard) and E/n experts (n = size of `expert`).
With n = 1 (no expert axis) the same body is the per-device grouped matmul of a multi-device
mesh: the weights are gathered whole, the all-to-alls are no-ops, and the grouped matmul runs on
local rows, as a Pallas kernel (megablox) must (XLA cannot partition it).
It sorts its M = T*K assignments by expert, sends each expert shard its rows, runs its experts on
what it received, and sends the results back. Two exchanges (`moe_ep_all_to_all`):

  padded  `all_to_all` of [n, M, D] (dropless, since one shard may receive every row): its own
          transpose, so differentiable on any platform; but every device sends and receives n*M rows
          whatever the routing (the plans: most of a pod's collective bytes and temporaries).
  ragged  `ragged_all_to_all` (ling2.layers.moe_a2a): each peer gets exactly its rows, into a receive
          buffer of `moe_ep_capacity_factor` x M rows (n*M when <= 0). Where some device's rows would
          overflow that bound, the layer's exchange runs padded for that step (one `lax.switch`, decided
          from the all-gathered counts every device holds): never a dropped token. XLA:CPU cannot run
          ragged all-to-all, so "auto" is padded there and "emulated" runs the ragged path's offsets with
          padded collectives (how CPU tests check it).
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ling2.layers import moe_a2a
from ling2.layers import moe_experts as X
from ling2.layers import sharding
from ling2.layers.moe_gmm import gather_rows, grouped_ffn


def expert_axis_size(mesh) -> int:
    return mesh.shape.get("expert", 1) if mesh is not None and not mesh.empty else 1


def batch_axes(mesh, rules, batch: int) -> tuple[str, ...]:
    """Mesh axes of the `activation_batch` rule that shard `batch` (each must divide what is left)."""
    axes, prod = [], 1
    for name, mesh_axes in rules:
        if name == "activation_batch":
            for a in mesh_axes or ():
                size = mesh.shape.get(a, 1)
                if size > 1 and batch % (prod * size) == 0:
                    axes.append(a)
                    prod *= size
    return tuple(axes)


def _local(x_TD, experts_TK, weights_TK, w, *, n: int, gmm: str, q=None):
    """Per-device body. w are this shard's experts [E/n, ...]."""
    T, K = experts_TK.shape
    M, e_loc = T * K, w[0].shape[0]
    order_M, gs_E = X.sort_by_expert(experts_TK, e_loc * n)
    inv_M = jnp.argsort(order_M)
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
    lgs = jnp.bincount(rids, length=e_loc + 1)[:e_loc].astype(jnp.int32)
    y_sorted = grouped_ffn(recv_nMD.reshape(n * M, -1)[lorder], lgs, w, gmm, q=q)
    y_nMD = y_sorted[jnp.argsort(lorder)].reshape(n, M, -1)

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


def _ragged(x_TD, experts_TK, weights_TK, *w, n: int, gmm: str, q, R: int, emulated: bool):
    """Per-device body with the ragged exchange into an R-row receive buffer (`_local`'s contract); the
    caller makes sure no device receives more than R rows."""
    T, K = experts_TK.shape
    M, e_loc = T * K, w[0].shape[0]
    order_M, gs_E = X.sort_by_expert(experts_TK, e_loc * n)
    inv_M = jnp.argsort(order_M)
    dispatch, combine = moe_a2a.plans(gs_E.reshape(n, e_loc).sum(1), "expert")
    x_MD = gather_rows(x_TD, order_M // K, inv_M, K)
    recv_RD = moe_a2a.exchange(x_MD, R, dispatch, combine, "expert", emulated)
    # The buffer holds sender 0's run (sorted by my experts), then sender 1's, ...: segment (i, e) ends at the
    # running sum of mine[i, e]; rows past the last segment are padding (id e_loc, sorted last).
    mine = jax.lax.all_gather(gs_E.reshape(n, e_loc), "expert")[:, jax.lax.axis_index("expert")]  # [sender, e]
    r = jnp.arange(R)
    seg = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), r, side="right")
    lorder = jnp.argsort(jnp.where(r < mine.sum(), seg % e_loc, e_loc), stable=True)
    linv = jnp.argsort(lorder)
    y_sorted = grouped_ffn(gather_rows(recv_RD, lorder, linv, 1), mine.sum(0).astype(jnp.int32), w, gmm, q=q)
    y_MD = moe_a2a.exchange(gather_rows(y_sorted, linv, lorder, 1), M, combine, dispatch, "expert", emulated)
    y_TKD = gather_rows(y_MD, inv_M, order_M, 1).reshape(T, K, -1)
    return X.combine(y_TKD, weights_TK, x_TD.dtype)


def _local_ragged(x_TD, experts_TK, weights_TK, w, *, n: int, gmm: str, q=None, capacity_factor: float,
                  emulated: bool):
    """Per-device body with the ragged exchange (`_local`'s contract), its receive buffer bounded by
    `capacity_factor`; a step whose routing overflows the bound on any device runs `_local` (padded).

    With a bound the choice is a `lax.switch` inside a custom VJP whose backward recomputes the taken branch's
    forward and differentiates it there: differentiating through the cond directly would keep the residuals
    of both branches (the padded one's n*M-row buffers included) whichever ran."""
    T, K = experts_TK.shape
    M = T * K
    R = recv_rows(M, n, capacity_factor)
    ragged = partial(_ragged, n=n, gmm=gmm, q=q, R=R, emulated=emulated)
    if R >= n * M:  # room for every row: no overflow is possible
        return ragged(x_TD, experts_TK, weights_TK, *w)
    padded = lambda x, e, g, *w: _local(x, e, g, w, n=n, gmm=gmm, q=q)

    def overflow(experts_TK):
        """0 when every device receives at most R rows, else 1 (the counts are summed over the group: one
        answer). The branch index of `lax.switch` over (ragged, padded): the ragged one first, which is the
        branch `hlo_traffic` counts."""
        count_n = jnp.bincount(experts_TK.reshape(-1) // (w[0].shape[0]), length=n)
        return (jnp.max(jax.lax.psum(count_n, "expert")) > R).astype(jnp.int32)

    @jax.custom_vjp
    def bounded(x, g, w, e):
        return jax.lax.switch(overflow(e), (ragged, padded), x, e, g, *w)

    def fwd(x, g, w, e):
        return bounded(x, g, w, e), (x, g, w, e)

    def bwd(res, ct):
        x, g, w, e = res

        def grads(fn):
            return lambda x, g, *w: jax.vjp(lambda x, g, *w: fn(x, e, g, *w), x, g, *w)[1](ct)

        dx, dg, *dw = jax.lax.switch(overflow(e), (grads(ragged), grads(padded)), x, g, *w)
        return dx, dg, tuple(dw), None

    bounded.defvjp(fwd, bwd)
    return bounded(x_TD, weights_TK, tuple(w), experts_TK)


def exchange_kind(a2a: str, n: int) -> str:
    """The exchange `moe_ep_all_to_all` names for an expert axis of n: "padded", "ragged", "emulated" or
    "auto" (decided for the platform lowered for)."""
    if a2a not in ("auto", "ragged", "padded", "emulated"):
        raise ValueError(f"moe_ep_all_to_all: unknown exchange {a2a!r} (auto, ragged, padded or emulated)")
    return "padded" if n == 1 else a2a


def dropless_ep(x_BSD, experts_BSK, weights_BSK, w, *, mesh, rules, gmm: str, q=None, a2a: str = "padded",
                capacity_factor: float = 0.0):
    """Routed output [B, S, D]; equals `moe_experts.dropless` on one device (same sums per token). `q`: FP8
    GEMMs (ling2.layers.fp8)."""
    n = expert_axis_size(mesh)
    E = w[0].shape[0]
    if E % n:
        raise ValueError(f"num_experts={E} is not divisible by the expert mesh axis ({n})")
    axes = batch_axes(mesh, rules, x_BSD.shape[0])
    if n > 1 and "expert" not in axes:
        raise ValueError(f"expert parallelism needs the batch ({x_BSD.shape[0]}) sharded over 'expert' by the "
                         f"activation_batch rule; it shards over {axes}")

    kind = exchange_kind(a2a, n)
    local = {"padded": partial(_local, n=n, gmm=gmm, q=q),
             "ragged": partial(_local_ragged, n=n, gmm=gmm, q=q, capacity_factor=capacity_factor, emulated=False),
             "emulated": partial(_local_ragged, n=n, gmm=gmm, q=q, capacity_factor=capacity_factor, emulated=True)}

    def body(x, e, g, wg, wu, wd):
        b, s, _ = x.shape
        args = (x.reshape(b * s, -1), e.reshape(b * s, -1), g.reshape(b * s, -1), (wg, wu, wd))
        if kind == "auto":
            y = jax.lax.platform_dependent(*args, cpu=local["padded"], default=local["ragged"])
        else:
            y = local[kind](*args)
        return y.reshape(x.shape)

    # Rows and positions split as activations (a context axis splits positions); _local needs exactly the
    # expert axis's shards of the weights.
    BSD, EXP = ("activation_batch", "activation_length", None), P("expert")
    f = sharding.shard_map_by_names(body, (BSD, BSD, BSD, EXP, EXP, EXP), BSD, rules, mesh=mesh)
    return f(x_BSD, experts_BSK, weights_BSK, *w)
