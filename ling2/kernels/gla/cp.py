"""Context parallelism for simple GLA: one sequence split in order over a mesh axis.

Call inside `shard_map`, each device holding a contiguous shard of T/n tokens (shard i of n
along `axis_name`). The state entering shard i is the composition of the earlier shards'
transitions: with zero state in, shard j ends in E_j (its last document's state) and passes
an incoming state on scaled by a_j = exp(sum of its log-decays), or not at all when a document
starts inside it. So
  S_j = a_j S_{j-1} + E_j       (S_{j-1} dropped when shard j starts a new document),
an exclusive scan of per-shard summaries. Two local passes of the chunked kernel:
  1. from the zero state: E_j (outputs discarded);
  2. all-gather (E, a, edge segment ids) over the axis, fold the earlier shards into S_{i-1},
     run the kernel from it: the outputs and final state of the unsplit sequence.
Per layer and shard: twice the local kernel's FLOPs, and an all-gather of n states [B, H, K, V]
fp32 (n x B x H x K x V x 4 bytes received). Gradients come from autodiff through both
passes and the all-gather (its transpose is a reduce-scatter), with the kernel's own VJP for
the state gradient, so every backend works under CP.

Packed documents: segment ids are global values, so a document that spans shards keeps its
id on both sides of an edge; a different id at a shard's first token starts a new document.
"""

import jax
import jax.numpy as jnp

from ling2.kernels.cp import entering_state
from ling2.kernels.gla.op import simple_gla


def shard_summary(g_BTH, seg_BT):
    """(log of a [B, H]: the shard's total log-decay, -inf where a document starts inside it; first and last
    segment ids [B])."""
    inside = jnp.any(seg_BT[:, 1:] != seg_BT[:, :-1], axis=1)
    log_a_BH = jnp.where(inside[:, None], -jnp.inf, jnp.sum(g_BTH.astype(jnp.float32), axis=1))
    return log_a_BH, seg_BT[:, 0], seg_BT[:, -1]


def incoming_state(end_NBHKV, log_a_NBH, first_NB, last_NB, shard):
    """The state entering shard `shard` (traced): S_j = a_j S_{j-1} + E_j over the shards before it."""
    return entering_state(lambda j, S: jnp.exp(log_a_NBH[j])[..., None, None] * S, end_NBHKV, first_NB, last_NB,
                          shard)


def simple_gla_cp(q, k, v, g, *, axis_name: str, segment_ids=None, scale=None, chunk_size=64, backend="auto",
                  return_final_state=False, interpret=None):
    """`simple_gla` on this device's shard of a sequence split over `axis_name` (see the module doc).

    Args as `simple_gla`, all local: q, k [B, T/n, H, K]; v [B, T/n, H, V]; g [H] or [B, T/n, H];
    segment_ids [B, T/n] (global ids, so edges between shards are seen). Returns o [B, T/n, H, V] and,
    if asked, the state after this shard's last token (the last shard's is the sequence's).
    """
    B, T, H, _ = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    g_BTH = jnp.broadcast_to(g.astype(jnp.float32), (B, T, H)) if g.ndim == 1 else g
    kw = dict(segment_ids=segment_ids, scale=scale, chunk_size=chunk_size, backend=backend, interpret=interpret,
              return_final_state=True)
    _, end_BHKV = simple_gla(q, k, v, g, **kw)
    summary = (end_BHKV, *shard_summary(g_BTH, segment_ids))
    gathered = [jax.lax.all_gather(x, axis_name) for x in summary]
    h0_BHKV = incoming_state(*gathered, jax.lax.axis_index(axis_name))
    o, hT_BHKV = simple_gla(q, k, v, g, initial_state=h0_BHKV, **kw)
    return (o, hT_BHKV) if return_final_state else o
