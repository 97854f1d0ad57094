"""Ling2 MoE block: y = sum_k w_k * expert_k(x) + shared_expert(x), plus losses and router stats.

Routing (ling2.layers.moe.router): fp32 gate, sigmoid or softmax scores, a selection-only
expert bias, group-limited top-k, weights from the unbiased scores.
Experts (ling2.layers.moe.experts): dropless sort + grouped matmul (`sparse_matmul`; with at
most E assignments, as in decoding, each token's experts' weights gathered instead), or the
dense one-hot path with `capacity_factor`. On a mesh whose `expert` axis is > 1 (the spec's
`run.mesh_shape`) the dropless path runs expert parallel (ling2.layers.moe.ep). The plan
(`ling2.layers.moe.plan.moe_plan`) is the one place that decides
which, and which grouped matmul and exchange run on the platform lowered for.

Everything the trainer needs comes back in `MoEAux`; nothing is sown or kept globally.
"""

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ling2.config.specs import MoESpec, RouterSpec
from ling2.kernels import fp8
from ling2.layers import sharding
from ling2.layers.moe import ep as moe_ep
from ling2.layers.moe import experts as moe_experts
from ling2.kernels.moe import gmm as moe_gmm
from ling2.layers.moe import plan as moe_plan
from ling2.layers.moe import router as moe_router
from ling2.layers.moe.experts import Mlp
from ling2.layers.moe.router import router_metrics, update_routed_bias

F32 = jnp.float32


@struct.dataclass
class MoEAux:
    """What one MoE call returns besides its output.

    lb_loss, z_loss: already weighted (0 when their weight is 0); add both to the loss.
    counts: assignments per expert [E] (int32) for loss-free balancing.
    stats: additive router statistics. Combine every entry (and `counts`) by SUM over
      micro-batches, then call `metrics()` / `router_metrics` once.
    """

    lb_loss: jax.Array
    z_loss: jax.Array
    counts: jax.Array
    stats: dict

    @property
    def loss(self):
        return self.lb_loss + self.z_loss

    def metrics(self, k: int) -> dict:
        return router_metrics(self.counts, self.stats, k)


def bias_update(bias_E, counts_E, spec: RouterSpec):
    """The once-per-optimizer-step expert bias update, with the configured rate and recentring."""
    return update_routed_bias(bias_E, counts_E, spec.routed_bias_update_rate, spec.routed_bias_zero_mean_update)


def matmul_params(spec: MoESpec, active: bool = True) -> int:
    """Router plus SwiGLU expert weights a token is multiplied by (`active`: its top-k routed experts;
    else all of them) plus the shared experts."""
    E, N, F = spec.emb_dim, spec.num_experts, spec.base_moe_mlp_dim
    experts = spec.num_experts_per_tok if active else N
    return E * N + experts * 3 * E * F + 3 * E * spec.shared_experts * spec.shared_expert_dim


class MoE(nnx.Module):
    """Routed + shared SwiGLU experts. x_BSD -> (y_BSD, MoEAux).

    `gmm` picks the dropless grouped matmul: "ragged_dot", "tiled" (fast on CPU), "megablox", or
    "auto"/None (run.moe_gmm_backend; "auto": chosen for the platform lowered for).
    """

    def __init__(self, spec: MoESpec, *, rngs: nnx.Rngs, gmm: str | None = None):
        self.spec = spec
        self.gmm = gmm or spec.run.moe_gmm_backend
        if self.gmm not in moe_gmm.GMMS:
            raise ValueError(f"gmm: unknown grouped matmul {self.gmm!r} (one of {moe_gmm.GMMS})")
        self.gate = moe_router.Router(spec, rngs=rngs)
        self.experts = moe_experts.RoutedExperts(spec, rngs=rngs)
        width = spec.shared_experts * spec.shared_expert_dim
        self.shared_experts = nnx.data(Mlp(spec, width, rngs=rngs) if width else None)

    def __call__(self, x_BSD, valid_BS=None):
        spec = self.spec
        B, S, D = x_BSD.shape
        T, K, E = B * S, spec.num_experts_per_tok, spec.num_experts
        dtype = jnp.dtype(spec.dtype)
        x_BSD = x_BSD.astype(dtype)
        valid_T = None if valid_BS is None else valid_BS.reshape(T).astype(bool)

        r = self.gate(x_BSD.reshape(T, D))
        counts_E = moe_router.expert_counts(r.experts_TK, E, valid_T)
        stats = moe_router.router_stat_sums(r, valid_T)
        stats["dropped"] = jnp.zeros((), F32)
        n_tok = jnp.maximum(stats["tokens"], 1)
        z_loss = lb_loss = jnp.zeros((), F32)
        if spec.moe_z_loss_weight > 0:
            stats["lse_sq_sum"] = moe_router.z_loss_sum(r.logits_TE, valid_T)
            z_loss = spec.moe_z_loss_weight * stats["lse_sq_sum"] / n_tok
        if spec.load_balance_loss_weight > 0:
            lb_loss = spec.load_balance_loss_weight * moe_router.load_balance_loss(r.scores_TE, counts_E, valid_T)

        w = self.experts.weights(dtype)
        gmm, q = self.gmm, fp8.of(spec.run)
        experts_BSK, weights_BSK = r.experts_TK.reshape(B, S, K), r.weights_TK.reshape(B, S, K)
        mesh_shape = dict(spec.run.mesh_shape)
        plans = moe_plan.plans(spec, mesh_shape, tokens=T, model_dim=D, gmm=gmm)
        path = plans["default"].path
        if path != "expert_parallel" and "expert" in getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
            raise ValueError(f"sparse_matmul: a pipeline over rows split on the expert axis holds only its "
                             f"experts' weights, which the {path} path cannot use; set sparse_matmul=true")
        if path == "dense_capacity":
            y_BSD, kept_BSK = moe_experts.dense_capacity(x_BSD, experts_BSK, weights_BSK, w, spec.capacity_factor, q)
            dropped_BSK = ~kept_BSK if valid_BS is None else ~kept_BSK & valid_BS.astype(bool)[..., None]
            stats["dropped"] = dropped_BSK.astype(F32).sum()
        elif path in ("expert_parallel", "per_device"):
            y_BSD = moe_ep.dropless_ep(x_BSD, experts_BSK, weights_BSK, w, mesh=sharding.mesh_of(spec.run),
                                       rules=spec.run.logical_axis_rules, plans=plans, q=q,
                                       capacity_factor=spec.run.moe_ep_capacity_factor)
        elif path == "gathered":
            y_BSD = moe_experts.gathered(x_BSD.reshape(T, D), r.experts_TK, r.weights_TK, w).reshape(B, S, D)
        else:
            y_BSD = moe_experts.dropless(x_BSD.reshape(T, D), r.experts_TK, r.weights_TK, w,
                                         partial(moe_plan.grouped_ffn, plans, q=q)).reshape(B, S, D)
        if self.shared_experts is not None:
            y_BSD = y_BSD + self.shared_experts(x_BSD)
        return y_BSD, MoEAux(lb_loss=lb_loss, z_loss=z_loss, counts=counts_E, stats=stats)
