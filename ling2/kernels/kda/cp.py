"""Context parallelism for KDA: one sequence split in order over a mesh axis.

Call inside `shard_map`, each device holding a contiguous shard (shard i of n along `axis_name`).
KDA's state update is affine in the state, S <- (I - beta k^T k) diag(exp g) S + beta k^T v, so a
shard maps the state entering it to A_j S + E_j, with A_j [K, K] (0 once a document starts inside
the shard: the kernel's reset drops it) and E_j the state it ends in from zero. One kernel pass
finds both: values [v | 0] from the initial state [0 | I] end in [E_j | A_j]. Then
  S_j = A_j S_{j-1} + E_j       (S_{j-1} dropped when shard j starts a new document),
an exclusive scan of the all-gathered (A, E, edge segment ids), and a second pass from the
incoming state gives the outputs and final state of the unsplit sequence.
Per layer and shard: the local kernel's FLOPs twice, the first pass V + K wide; an all-gather of n
x B x H x K x (K + V) fp32. Gradients come from autodiff through both passes and the all-gather,
with the kernel's own VJP for the state, so every backend works under CP. The layer's short
convolution, which also reaches across the edge, is the layer's own business.

Segment ids are global values: a document spanning shards keeps its id on both sides of an edge.
"""

import jax
import jax.numpy as jnp

from ling2.kernels.cp import entering_state
from ling2.kernels.kda.op import kda


def incoming_state(A_NBHKK, E_NBHKV, first_NB, last_NB, shard):
    """The state entering shard `shard` (traced): S_j = A_j S_{j-1} + E_j over the shards before it."""
    advance = lambda j, S: jnp.einsum("bhij,bhjv->bhiv", A_NBHKK[j], S, precision="highest")  # noqa: E731
    return entering_state(advance, E_NBHKV, first_NB, last_NB, shard)


def kda_cp(q, k, v, g, beta, *, axis_name: str, segment_ids=None, scale=None, chunk_size=64, backend="auto",
           return_final_state=False, interpret=None):
    """`kda` on this device's shard of a sequence split over `axis_name` (see the module doc).

    Args as `kda`, all local: q, k, g [B, T/n, H, K]; v [B, T/n, H, V]; beta [B, T/n, H]; segment_ids
    [B, T/n] (global ids). Returns o [B, T/n, H, V] and, if asked, the state after this shard's last token.
    """
    B, T, H, K = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    kw = dict(segment_ids=segment_ids, scale=scale, chunk_size=chunk_size, backend=backend, interpret=interpret,
              return_final_state=True)
    Vd = v.shape[-1]
    probe_v = jnp.concatenate([v, jnp.zeros((B, T, H, K), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
    probe_h0 = jnp.concatenate([jnp.zeros((B, H, K, Vd), jnp.float32), eye], axis=-1)
    _, ends = kda(q, k, probe_v, g, beta, initial_state=probe_h0, **kw)
    summary = (ends[..., Vd:], ends[..., :Vd], segment_ids[:, 0], segment_ids[:, -1])
    gathered = [jax.lax.all_gather(x, axis_name) for x in summary]
    h0_BHKV = incoming_state(*gathered, jax.lax.axis_index(axis_name))
    o, hT_BHKV = kda(q, k, v, g, beta, initial_state=h0_BHKV, **kw)
    return (o, hT_BHKV) if return_final_state else o
