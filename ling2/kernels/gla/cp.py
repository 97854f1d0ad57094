"""Context parallelism for simple GLA: one sequence split in order over a mesh axis.

Call inside `shard_map`, each device holding a contiguous shard of T/n tokens (shard i of n
along `axis_name`). The recurrence is linear in the state, so a shard's outputs and end state
split into what it makes from the zero state and what the state S_{i-1} entering it adds:
  o_t = o_t^0 + scale (q_t e^{G_t}) S_{i-1},    S_i = E_i + a_i S_{i-1},
with G_t the shard's log-decays summed through t (inclusive) and a_i = e^{G_last}. The kernel
drops the state at a new document, so both terms from S_{i-1} vanish from the shard's first
document start on (a_i = 0 once a document starts inside the shard), and the entering state is
an exclusive scan of per-shard summaries (S_{j-1} dropped when shard j starts a new document).
One local pass of the kernel, from the zero state, gives o^0 and E_i; (E, a, edge segment ids)
are all-gathered over the axis and folded into S_{i-1}, which enters through the correction,
an fp32 einsum [B, T/n, H, K] x [B, H, K, V] added to o^0 before the cast to the output dtype.
Per layer and shard: the local kernel plus one K x V matmul per token (2KV FLOPs against the
chunked kernel's 2C(K + V) + 4KV; the backward likewise), i.e. about 1.25x the kernel's FLOPs at
K = V = C and 1.33x at K = V = 2C; and an all-gather of n states [B, H, K, V] fp32 (n x B x H x
K x V x 4 bytes received). Gradients come from autodiff through the pass, the correction and the
all-gather (its transpose is a reduce-scatter), so every backend works under CP.

Packed documents: segment ids are global values, so a document that spans shards keeps its
id on both sides of an edge; a different id at a shard's first token starts a new document.
"""

import jax
import jax.numpy as jnp

from ling2.kernels.cp import entering_state
from ling2.kernels.gla.op import simple_gla
from ling2.kernels.layout import doc_index


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


def entering_output(q_BTHK, g_BTH, seg_BT, h0_BHKV, scale):
    """What the state h0 entering the shard adds to its outputs, fp32 [B, T, H, V]: scale (q_t e^{G_t}) h0 on the
    shard's first document, 0 from the first token of another on."""
    f32 = jnp.float32
    G_BTH = jnp.cumsum(g_BTH.astype(f32), axis=1)
    decay_BTH = jnp.where((doc_index(seg_BT) == 0)[..., None], scale * jnp.exp(G_BTH), 0.0)
    return jnp.einsum("bthk,bhkv->bthv", q_BTHK.astype(f32) * decay_BTH[..., None], h0_BHKV,
                      precision=jax.lax.Precision.HIGHEST)


def simple_gla_cp(q, k, v, g, *, axis_name: str, segment_ids=None, scale=None, chunk_size=64, backend="auto",
                  return_final_state=False, interpret=None):
    """`simple_gla` on this device's shard of a sequence split over `axis_name` (see the module doc).

    Args as `simple_gla`, all local: q, k [B, T/n, H, K]; v [B, T/n, H, V]; g [H] or [B, T/n, H];
    segment_ids [B, T/n] (global ids, so edges between shards are seen). Returns o [B, T/n, H, V] and,
    if asked, the state after this shard's last token (the last shard's is the sequence's).
    """
    B, T, H, K = q.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    scale = K**-0.5 if scale is None else float(scale)
    if g.ndim == 1:  # a constant of the model: the barrier keeps XLA from folding the [B, T, H] decays (op.py)
        g_BTH = jnp.broadcast_to(jax.lax.optimization_barrier(g.astype(jnp.float32)), (B, T, H))
    else:
        g_BTH = g
    o0_BTHV, end_BHKV = simple_gla(q, k, v, g, segment_ids=segment_ids, scale=scale, chunk_size=chunk_size,
                                   backend=backend, interpret=interpret, return_final_state=True)
    log_a_BH, first_B, last_B = shard_summary(g_BTH, segment_ids)
    gathered = [jax.lax.all_gather(x, axis_name) for x in (end_BHKV, log_a_BH, first_B, last_B)]
    h0_BHKV = incoming_state(*gathered, jax.lax.axis_index(axis_name))
    o_BTHV = o0_BTHV.astype(jnp.float32) + entering_output(q, g_BTH, segment_ids, h0_BHKV, scale)
    o_BTHV = o_BTHV.astype(o0_BTHV.dtype)
    if not return_final_state:
        return o_BTHV
    return o_BTHV, end_BHKV + jnp.exp(log_a_BH)[..., None, None] * h0_BHKV
