"""What the context-parallel kernels (gla/cp.py, kda/cp.py) share: the exclusive scan of shard summaries."""

import jax.numpy as jnp


def entering_state(advance, end_NBHKV, first_NB, last_NB, shard):
    """The state entering shard `shard` (traced) of n: S_j = advance(j, S_{j-1}) + E_j folded over the shards
    before it, S dropped where a shard starts a new document (its first segment id differs from the previous
    shard's last). `advance(j, S)` carries S across shard j (0 once a document starts inside it)."""
    S, entering = jnp.zeros_like(end_NBHKV[0]), []
    for j in range(end_NBHKV.shape[0]):
        if j:
            S = jnp.where((first_NB[j] == last_NB[j - 1])[:, None, None, None], S, 0.0)
        entering.append(S)
        S = advance(j, S) + end_NBHKV[j]
    return jnp.stack(entering)[shard]
