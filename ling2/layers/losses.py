"""Token cross-entropy sums shared by the main loss, the MTP depths and evaluation.

Returns sums, not means, so gradient accumulation and MTP can normalise exactly once.
"""

import jax
import jax.numpy as jnp


def cross_entropy_sums(logits_BTV, targets_BT, weights_BT):
    """(sum of weighted token CE, sum of weights, sum of weighted argmax hits), all fp32."""
    logits = logits_BTV.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    w = weights_BT.astype(jnp.float32)
    hits = (jnp.argmax(logits, -1) == targets_BT).astype(jnp.float32)
    return jnp.sum((lse - tgt) * w), jnp.sum(w), jnp.sum(hits * w)
