"""AdamW with warmup then cosine / WSD / constant decay (wsm: constant, merged instead of decayed), global-norm clipping and a weight-decay mask.

Decay is applied by parameter role (`ling2.layers.model.param_roles`), never by shape: weight
matrices are decayed; norm scales and expert biases are not, stacked [n, D] under `scan_layers`
or not; the token embedding only with `weight_decay_embeddings`.
"""

import jax
import optax

from ling2.layers.model import param_roles
from ling2.layers.spec import ModelSpec


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
    """True where weight decay applies: a pytree like `params` (Ling2Model state paths, nnx.State or
    pure dict). Raises ValueError for a parameter that is not part of the Ling2Model of `cfg`."""
    roles = {tuple(map(str, p)): r for p, r in param_roles(ModelSpec.of(cfg)).items()}

    def decayed(path, x):
        key = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        if key not in roles and key[-1:] == ("value",):  # nnx.State leaves end in Variable.value
            key = key[:-1]
        if key not in roles:
            raise ValueError(f"weight decay: {'/'.join(key)} is not a parameter of the {cfg.model_name} model")
        role = roles[key]
        return role == "matrix" or (role == "embedding" and cfg.weight_decay_embeddings)

    return jax.tree_util.tree_map_with_path(decayed, params)


def updates_applied(opt_state):
    """How many updates optax has applied: the step its learning-rate schedule is at. A skipped
    (non-finite) step keeps the old optimizer state, so this lags the train state's step after one."""
    counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
              if isinstance(s, optax.ScaleByScheduleState)]
    if not counts:
        raise ValueError("optimizer state has no learning-rate schedule count")
    return counts[0]


def make_optimizer(cfg, params):
    """The optax transform for `params` (a pytree of fp32 arrays)."""
    sched = lr_schedule(cfg)
    return optax.chain(
        optax.clip_by_global_norm(cfg.gradient_clipping_threshold) if cfg.gradient_clipping_threshold > 0
        else optax.identity(),
        optax.adamw(sched, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.adam_weight_decay,
                    mu_dtype=cfg.mu_dtype or None, mask=decay_mask(params, cfg)),
    ), sched

