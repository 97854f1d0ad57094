"""Expert parallelism: routed experts sharded over the `expert` mesh axis, tokens moved by all-to-all.

Inside `shard_map`, each device holds T local tokens (its rows' positions on its context shard) and E/n experts (n = size of `expert`).
With n = 1 (no expert axis) the same body is the per-device grouped matmul of a multi-device
mesh: the weights are gathered whole, the all-to-alls are no-ops, and the grouped matmul runs on
local rows, as a Pallas kernel (megablox) must (XLA cannot partition it).
It sorts its M = T*K assignments by expert, sends each expert shard its rows through a
padded `all_to_all` ([n, M, D]: dropless, since one shard may receive every row), runs its
experts on what it received, and sends the results back the same way.

`all_to_all` is its own transpose, so the path is differentiable everywhere. jax 0.10.2 can
differentiate `ragged_all_to_all` (its gradient program lowers), but XLA:CPU cannot run it
("HLO opcode ragged-all-to-all is not supported"), so the padded form is the one used and
tested. Its cost: send/receive buffers of n*M rows per device instead of ~M.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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


def dropless_ep(x_BSD, experts_BSK, weights_BSK, w, *, mesh, rules, gmm: str, q=None):
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

    def body(x, e, g, wg, wu, wd):
        b, s, _ = x.shape
        y = _local(x.reshape(b * s, -1), e.reshape(b * s, -1), g.reshape(b * s, -1), (wg, wu, wd), n=n, gmm=gmm, q=q)
        return y.reshape(x.shape)

    # Rows and positions split as activations (a context axis splits positions); _local needs exactly the
    # expert axis's shards of the weights.
    BSD, EXP = ("activation_batch", "activation_length", None), P("expert")
    f = sharding.shard_map_by_names(body, (BSD, BSD, BSD, EXP, EXP, EXP), BSD, rules, mesh=mesh)
    return f(x_BSD, experts_BSK, weights_BSK, *w)
