"""The trained model and its expert-bias bookkeeping (loss-free balancing across layers)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.layers.mtp import DecoderWithMTP
from ling2.layers.moe import bias_update
from ling2.layers.moe_router import RoutedBias


# The trained model: the decoder plus, when cfg.mtp_num_layers > 0, its MTP modules.
Model = DecoderWithMTP


def bias_rows(model: Model) -> list[tuple[RoutedBias, list[int]]]:
    """Every expert-bias variable with the global layer index of each of its rows.

    A variable of shape [E] has one row; a scanned group's stacked [n, E] has n.
    """
    d, out = model.decoder, []

    def add(module, idx):
        gate = getattr(getattr(module, "mlp", None), "gate", None)
        if gate is not None and isinstance(getattr(gate, "expert_bias", None), RoutedBias):
            out.append((gate.expert_bias, idx))

    if not d.scan:
        for i, layer in enumerate(d.layers):
            add(layer, [i])
    else:
        p, n, k = len(d.prefix), d.num_groups, d.group_size
        for i, layer in enumerate(d.prefix):
            add(layer, [i])
        if n:
            for j, layer in enumerate(d.groups.layers):
                add(layer, [p + g * k + j for g in range(n)])
        for j, layer in enumerate(d.suffix):
            add(layer, [d.num_layers_before_suffix() + j])
    if model.mtp is not None:
        for k, depth in enumerate(model.mtp.depths):
            add(depth.layer, [model.mtp.first_layer_idx + k])
    return out


def apply_bias_updates(model: Model, counts: dict, cfg) -> None:
    """Loss-free balancing: one update per optimizer step from counts summed over micro-batches."""
    for var, idx in bias_rows(model):
        cur = var[...]
        rows = cur.reshape(len(idx), -1)
        new = jnp.stack([bias_update(rows[r], counts[i], cfg) for r, i in enumerate(idx)])
        var[...] = new.reshape(cur.shape).astype(cur.dtype)


def count_params(model) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
