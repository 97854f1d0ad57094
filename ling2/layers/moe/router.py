"""MoE router: fp32 gate, group-limited top-k with a selection-only bias, losses, stats, bias update.

Shapes: T tokens, D model dim, E experts, G routing groups, K experts per token.
Everything here is pure (arrays in, arrays out) except the small `Router` module.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ling2.config.specs import RouterSpec

F32 = jnp.float32


class RoutedBias(nnx.Variable):
    """Selection-only expert bias [E] (loss-free balancing).

    Not an `nnx.Param`: the trainer leaves it out of the optimizer unless
    `enable_routed_bias_grad`, and changes it with `update_routed_bias` once per step.
    """


class Routing(NamedTuple):
    weights_TK: jax.Array  # f32: the unbiased scores, normalised if configured, times routed_scaling_factor
    experts_TK: jax.Array  # int32 expert ids, best first
    logits_TE: jax.Array  # f32 gate logits
    scores_TE: jax.Array  # f32 unbiased sigmoid/softmax scores


def scores_from_logits(logits_TE, score_func: str):
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    if score_func == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    raise ValueError(f"routed_score_func: unknown {score_func!r} (sigmoid or softmax)")


def select_experts(choice_TE, k: int, n_groups: int, topk_groups: int):
    """Top-k expert ids [T, K] of `choice_TE` (scores + bias) among the best `topk_groups` groups.

    A group's score is the sum of its two best choice scores; experts of the other groups
    are masked to -inf. Ties go to the lower index (lax.top_k is stable).
    """
    T, E = choice_TE.shape
    if n_groups > 1:
        per_group = E // n_groups
        top2_TG2, _ = jax.lax.top_k(choice_TE.reshape(T, n_groups, per_group), 2)
        _, keep_TG = jax.lax.top_k(top2_TG2.sum(-1), topk_groups)
        mask_TG = jnp.zeros((T, n_groups), bool).at[jnp.arange(T)[:, None], keep_TG].set(True)
        choice_TE = jnp.where(jnp.repeat(mask_TG, per_group, axis=1), choice_TE, -jnp.inf)
    _, experts_TK = jax.lax.top_k(choice_TE, k)
    return experts_TK.astype(jnp.int32)


def route(x_TD, kernel_DE, bias_E, spec: RouterSpec) -> Routing:
    """Routes T tokens. The gate matmul is fp32 at full precision whatever the compute dtype is.

    The weights are the chosen experts' unbiased scores, divided by their sum (+1e-20) when
    `sigmoid_renormalize` (sigmoid) or `norm_topk_prob` (softmax) asks for it, then times
    `routed_scaling_factor` either way, as the DeepSeek-V3 and Ling 3 routers do."""
    logits_TE = jnp.dot(x_TD.astype(F32), kernel_DE.astype(F32), precision=jax.lax.Precision.HIGHEST)
    scores_TE = scores_from_logits(logits_TE, spec.routed_score_func)
    choice_TE = scores_TE if bias_E is None else scores_TE + bias_E.astype(F32)
    experts_TK = select_experts(choice_TE, spec.num_experts_per_tok, spec.n_routing_groups, spec.topk_routing_group)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    renormalize = spec.sigmoid_renormalize if spec.routed_score_func == "sigmoid" else spec.norm_topk_prob
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
    return Routing(weights_TK * spec.routed_scaling_factor, experts_TK, logits_TE, scores_TE)


class Router(nnx.Module):
    """Gate kernel [D, E] (HF `gate.weight` transposed) and the optional expert bias [E].

    The bias reaches the output only through the top-k choice, so even with
    enable_routed_bias_grad its autodiff gradient is zero; `update_routed_bias` moves it.
    """

    def __init__(self, spec: RouterSpec, *, rngs: nnx.Rngs):
        self.spec = spec
        init = nnx.initializers.normal(spec.init_std)
        self.kernel = nnx.Param(init(rngs.params(), (spec.emb_dim, spec.num_experts), jnp.dtype(spec.weight_dtype)),
                                out_sharding=("embed", None), eager_sharding=False)
        bias = RoutedBias(jnp.zeros((spec.num_experts,), jnp.dtype(spec.routed_bias_dtype_resolved)))
        self.expert_bias = nnx.data(bias if spec.routed_bias else None)

    def __call__(self, x_TD) -> Routing:
        bias = None
        if self.expert_bias is not None:
            bias = self.expert_bias[...]
            if not self.spec.enable_routed_bias_grad:
                bias = jax.lax.stop_gradient(bias)
        return route(x_TD, self.kernel[...], bias, self.spec)


def expert_counts(experts_TK, num_experts: int, valid_T=None):
    """Assignments per expert [E] (int32), counting only valid tokens."""
    onehot_TKE = jax.nn.one_hot(experts_TK, num_experts, dtype=jnp.int32)
    if valid_T is not None:
        onehot_TKE = onehot_TKE * valid_T.astype(jnp.int32)[:, None, None]
    return onehot_TKE.sum((0, 1))


def _masked_sum(v_T, valid_T):
    return v_T.sum() if valid_T is None else jnp.where(valid_T, v_T, 0).sum()


def _num_tokens(T, valid_T):
    return jnp.asarray(T, F32) if valid_T is None else valid_T.astype(F32).sum()


def z_loss_sum(logits_TE, valid_T=None):
    """Sum over valid tokens of logsumexp(logits)^2 (ST-MoE z-loss, before the mean and weight)."""
    return _masked_sum(jax.nn.logsumexp(logits_TE, axis=-1) ** 2, valid_T)


def load_balance_loss(scores_TE, counts_E, valid_T=None):
    """E * sum_e f_e * P_e: f_e = share of assignments to e, P_e = mean normalised score of e.

    Equals 1 for a perfectly balanced router; gradients flow through P only.
    """
    E = scores_TE.shape[-1]
    p_TE = scores_TE / scores_TE.sum(-1, keepdims=True)
    if valid_T is not None:
        p_TE = jnp.where(valid_T[:, None], p_TE, 0)
    n = jnp.maximum(_num_tokens(scores_TE.shape[0], valid_T), 1)
    f_E = counts_E.astype(F32) / jnp.maximum(counts_E.sum(), 1)
    return E * jnp.sum(f_E * p_TE.sum(0) / n)


def router_stat_sums(routing: Routing, valid_T=None) -> dict:
    """Additive router statistics of one call: combine micro-batches by SUM, then `router_metrics`."""
    p_TE = routing.scores_TE / routing.scores_TE.sum(-1, keepdims=True)
    entropy_T = -jnp.sum(p_TE * jnp.log(jnp.maximum(p_TE, 1e-30)), -1)
    topk_T = jnp.take_along_axis(routing.scores_TE, routing.experts_TK, -1).mean(-1)
    return {
        "tokens": _num_tokens(routing.scores_TE.shape[0], valid_T),
        "entropy_sum": _masked_sum(entropy_T, valid_T),
        "topk_score_sum": _masked_sum(topk_T, valid_T),
    }


def router_metrics(counts_E, sums: dict, k: int) -> dict:
    """Metrics from summed counts and stat sums (exact after summing any number of micro-batches).

    tpe_*: tokens-per-expert min, max and coefficient of variation (std/mean);
    max_violation: max load / mean load - 1; entropy: mean entropy of the normalised scores;
    topk_score: mean unbiased score of the chosen experts; z_loss: mean logsumexp^2 (unweighted,
    present when computed); dropped_frac: dropped assignments / all assignments (dense path).
    """
    c = counts_E.astype(F32)
    mean = jnp.maximum(c.mean(), 1e-9)
    n = jnp.maximum(sums["tokens"], 1)
    out = {
        "tpe_min": c.min(), "tpe_max": c.max(), "tpe_cv": c.std() / mean, "max_violation": c.max() / mean - 1,
        "entropy": sums["entropy_sum"] / n, "topk_score": sums["topk_score_sum"] / n,
        "dropped_frac": sums.get("dropped", jnp.zeros((), F32)) / (n * k),
    }
    if "lse_sq_sum" in sums:
        out["z_loss"] = sums["lse_sq_sum"] / n
    return out


def update_routed_bias(bias_E, counts_E, rate: float, zero_mean: bool):
    """Loss-free balancing step: bias += rate * sign(mean(count) - count), optionally recentred.

    `counts_E` are the assignments summed over all micro-batches of one optimizer step.
    Computed in fp32, returned in the bias dtype.
    """
    c = counts_E.astype(F32)
    b = bias_E.astype(F32) + rate * jnp.sign(c.mean() - c)
    if zero_mean:
        b = b - b.mean()
    return b.astype(bias_E.dtype)
