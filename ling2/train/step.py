"""One optimizer step: gradient accumulation over micro-batches, MoE and MTP losses,
NaN/Inf skipping, and the once-per-step loss-free bias update.

Batch arrays are [M, b, S] (M = gradient_accumulation_steps micro-batches of b rows).
Normalisation (`calculate_per_token_loss`, `normalise`):
  True:  loss = sum of token losses over all micro-batches / all their tokens;
  False: each micro-batch averages its own tokens, micro-batches weigh 1/M each.
Both are exact: token totals come from the batch before the forward passes, so each
micro-batch's objective is already scaled and their gradients simply add up.
MoE aux losses (already per-token means inside a layer) weigh 1/M per micro-batch.

Axes in names: M micro-batches, B rows of a micro-batch (b above), S positions, K MTP depths,
E experts.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ling2.layers.model import update_expert_biases
from ling2.layers.spec import ModelSpec
from ling2.layers.mtp import depth_token_counts
from ling2.train.optim import updates_applied
from ling2.train.state import TrainState

F32 = jnp.float32


def normalise(loss_sum, tokens, step_tokens, cfg):
    """A loss sum over `tokens` tokens as a loss: over the whole step's `step_tokens` with
    `calculate_per_token_loss`, else over its own tokens and weighed 1/M (a micro-batch's mean)."""
    if cfg.calculate_per_token_loss:
        return loss_sum / jnp.maximum(step_tokens, 1)
    return loss_sum / jnp.maximum(tokens, 1) / cfg.gradient_accumulation_steps


def forward(graphdef, params, rest, mb, cfg, step_tokens):
    """Objective of one micro-batch (already scaled for accumulation) and its additive sums: "loss" and
    "mtp_loss" [K] are its shares of the step's losses. `step_tokens`: the step's token counts,
    {"tokens": [], "mtp_tokens": [K]}, from the batch."""
    model = nnx.merge(graphdef, params, rest)
    s = model.loss_sums(mb["inputs"], mb["targets"], mb["loss_weights"], mb["positions"], mb["segment_ids"])
    M = cfg.gradient_accumulation_steps
    loss = normalise(s.ce, s.tokens, step_tokens["tokens"], cfg)
    objective = loss
    sums = {"loss": loss, "ce": s.ce, "tokens": s.tokens, "hits": s.hits}
    if s.mtp is not None:
        mo = s.mtp
        mtp_loss_K = normalise(mo.ce_sum, mo.ce_count, step_tokens["mtp_tokens"], cfg)
        objective += cfg.mtp_loss_scaling_factor * jnp.mean(mtp_loss_K)
        sums.update(mtp_loss=mtp_loss_K, mtp_tokens=mo.ce_count, mtp_correct=mo.correct)
    aux_loss = sum((a.loss for a in s.moe_aux.values()), jnp.zeros((), F32))
    objective += aux_loss / M
    sums["aux_loss"] = aux_loss
    sums["moe_counts"] = {i: a.counts.astype(F32) for i, a in s.moe_aux.items()}  # [E] per MoE layer
    sums["moe_stats"] = {i: a.stats for i, a in s.moe_aux.items()}
    return objective, sums


def train_step(graphdef, tx, cfg, state: TrainState, batch: dict, lr_fn):
    """Returns (new state, metrics). Pure; jit it with graphdef/tx/cfg/lr_fn static.

    metrics["lr"] is the rate this step's update used: the schedule at optax's update count, which
    skipped steps do not advance (unlike state.step)."""
    M = cfg.gradient_accumulation_steps
    step_tokens = {"tokens": jnp.sum(batch["loss_weights"].astype(F32))}
    if cfg.mtp_num_layers:
        tokens_MK = jax.vmap(lambda w_BS, seg_BS: depth_token_counts(w_BS, seg_BS, cfg.mtp_num_layers))(
            batch["loss_weights"], batch["segment_ids"])
        step_tokens["mtp_tokens"] = jnp.sum(tokens_MK, axis=0)

    grad_fn = jax.grad(forward, argnums=1, has_aux=True)

    def micro(carry, mb):
        g_acc, s_acc = carry
        g, sums = grad_fn(graphdef, state.params, state.rest, mb, cfg, step_tokens)
        return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, sums)), None

    mb0 = jax.tree.map(lambda x_MBS: x_MBS[0], batch)
    sums_shape = jax.eval_shape(lambda: forward(graphdef, state.params, state.rest, mb0, cfg, step_tokens)[1])
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)
    (grads, sums), _ = jax.lax.scan(micro, (zeros(state.params), zeros(sums_shape)), batch)

    gnorm = optax.global_norm(grads)
    finite = jnp.isfinite(gnorm) & jnp.isfinite(sums["ce"])
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = jax.tree.map(lambda p, u: p + u.astype(p.dtype), state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    params = keep(new_params, state.params)
    opt_state = keep(new_opt, state.opt_state)

    rest = state.rest
    if cfg.routed_bias:  # on skipped steps too (their counts are finite); in params or rest, per `trainable_filter`
        params, rest = (update_expert_biases(tree, sums["moe_counts"], ModelSpec.of(cfg)) for tree in (params, rest))

    skipped = jnp.where(finite, 0, state.skipped + 1)
    new_state = TrainState(step=state.step + 1, params=params, rest=rest, opt_state=opt_state, skipped=skipped,
                           skipped_total=state.skipped_total + (~finite).astype(jnp.int32))
    metrics = {"loss": sums["loss"], "grad_norm": gnorm, "lr": lr_fn(updates_applied(state.opt_state)),
               "finite": finite.astype(F32), "tokens": sums["tokens"],
               "aux_loss": sums["aux_loss"] / M, "accuracy": sums["hits"] / jnp.maximum(sums["tokens"], 1)}
    if cfg.mtp_num_layers:
        mtp_K = sums["mtp_loss"]
        metrics["mtp_loss"] = {f"depth_{k + 1}": mtp_K[k] for k in range(cfg.mtp_num_layers)}
        metrics["mtp_top1_accuracy"] = {f"depth_{k + 1}": sums["mtp_correct"][k] / jnp.maximum(sums["mtp_tokens"][k], 1)
                                     for k in range(cfg.mtp_num_layers)}
        metrics["mtp_total"] = cfg.mtp_loss_scaling_factor * jnp.mean(mtp_K)
    metrics["moe"] = {"counts": sums["moe_counts"], "stats": sums["moe_stats"]}
    return new_state, metrics


def jit_train_step(graphdef, tx, cfg, lr_fn):
    """train_step compiled for this model and optimizer; the state argument is donated."""
    return jax.jit(functools.partial(train_step, graphdef, tx, cfg, lr_fn=lr_fn), donate_argnums=(0,))
