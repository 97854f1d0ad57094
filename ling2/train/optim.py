"""AdamW with warmup then cosine / WSD / constant decay, global-norm clipping and a weight-decay mask.

Decay is applied to matrices only: norms, biases (ndim < 2) and, unless
`weight_decay_embeddings`, the token embedding are left undecayed.
"""

import jax
import optax


def lr_schedule(cfg):
    """step -> learning rate. Warmup is linear from 0; decay ends at final_lr_fraction * lr."""
    peak, steps = cfg.learning_rate, cfg.steps
    warm = int(round(cfg.warmup_steps_fraction * steps))
    final = cfg.final_lr_fraction * peak
    rest = max(steps - warm, 1)
    if cfg.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, rest, alpha=cfg.final_lr_fraction)
    elif cfg.lr_schedule == "wsd":
        n_decay = max(int(round(cfg.wsd_decay_steps_fraction * steps)), 1)
        stable = max(rest - n_decay, 0)
        decay = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, final, n_decay)], [stable])
    else:
        decay = optax.constant_schedule(peak)
    if warm == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), decay], [warm])


def decay_mask(params, cfg):
    """True where weight decay applies: matrices, except the embedding unless configured."""

    def keep(path, x):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        if x.ndim < 2:
            return False
        if not cfg.weight_decay_embeddings and any("embed" in n for n in names):
            return False
        return True

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg, params):
    """The optax transform for `params` (a pytree of fp32 arrays)."""
    sched = lr_schedule(cfg)
    return optax.chain(
        optax.clip_by_global_norm(cfg.gradient_clipping_threshold) if cfg.gradient_clipping_threshold > 0
        else optax.identity(),
        optax.adamw(sched, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.adam_weight_decay,
                    mask=decay_mask(params, cfg)),
    ), sched

