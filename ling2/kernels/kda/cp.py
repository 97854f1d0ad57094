"""Context parallelism for KDA: one sequence split in order over a mesh axis.

Call inside `shard_map`, each device holding a contiguous shard (shard i of n along `axis_name`).
KDA's state update is affine in the state, S <- (I - beta k^T k) diag(exp g) S + beta k^T v, so
over the shard's first t tokens the state entering it maps to S_t = P_t S_{i-1} + E_t, with P_t
[K, K] (0 from the shard's first document start on: the kernel's reset drops it) and E_t the
state reached from zero. Outputs and end state split the same way:
  o_t = o_t^0 + W_t S_{i-1},  W_t = scale q_t P_t [K];    S_i = E_i + A_i S_{i-1},  A_i = P_last.
Every value column evolves on its own, so one kernel pass on values [v | 0] from the initial
state [0 | I] (V + K columns) returns all four: outputs [o^0 | W], end state [E_i | A_i]. Then
  S_i = A_i S_{i-1} + E_i       (S_{i-1} dropped when shard i starts a new document),
an exclusive scan of the all-gathered (A, E, edge segment ids), gives the entering state, and
o^0 + W S_{i-1} (fp32, then cast) and E_i + A_i S_{i-1} are the outputs and final state of the
unsplit sequence. Per layer and shard: one kernel pass V + K wide (the decay products and the
chunk inverse are shared by all columns, the rest grows with the width: about 1.8x the local
kernel's FLOPs at K = V = 128, chunk 64, forward and backward), one K x V matmul per token for
the correction, and an all-gather of n x B x H x K x (K + V) fp32. Gradients come from autodiff
through the pass, the correction and the all-gather, with the kernel's own VJP, so every backend
works under CP. The layer's short convolution, which also reaches across the edge, is the
layer's own business.

Segment ids are global values: a document spanning shards keeps its id on both sides of an edge.
"""

import jax
import jax.numpy as jnp

from ling2.kernels.cp import entering_state
from ling2.kernels.kda.op import kda
from ling2.kernels.kda.reference import acc_dtype

_HI = jax.lax.Precision.HIGHEST


def incoming_state(A_NBHKK, E_NBHKV, first_NB, last_NB, shard):
    """The state entering shard `shard` (traced): S_j = A_j S_{j-1} + E_j over the shards before it."""
    advance = lambda j, S: jnp.einsum("bhij,bhjv->bhiv", A_NBHKK[j], S, precision=_HI)  # noqa: E731
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
    Vd = v.shape[-1]
    probe_v = jnp.concatenate([v, jnp.zeros((B, T, H, K), v.dtype)], axis=-1)
    acc = acc_dtype(q.dtype)
    eye = jnp.broadcast_to(jnp.eye(K, dtype=acc), (B, H, K, K))
    probe_h0 = jnp.concatenate([jnp.zeros((B, H, K, Vd), acc), eye], axis=-1)
    out_BTHX, end_BHKX = kda(q, k, probe_v, g, beta, segment_ids=segment_ids, initial_state=probe_h0, scale=scale,
                             chunk_size=chunk_size, backend=backend, interpret=interpret, return_final_state=True)
    o0_BTHV, W_BTHK = out_BTHX[..., :Vd], out_BTHX[..., Vd:]
    E_BHKV, A_BHKK = end_BHKX[..., :Vd], end_BHKX[..., Vd:]
    summary = (A_BHKK, E_BHKV, segment_ids[:, 0], segment_ids[:, -1])
    gathered = [jax.lax.all_gather(x, axis_name) for x in summary]
    h0_BHKV = incoming_state(*gathered, jax.lax.axis_index(axis_name))
    o_BTHV = o0_BTHV.astype(acc) + jnp.einsum("bthk,bhkv->bthv", W_BTHK.astype(acc), h0_BHKV, precision=_HI)
    o_BTHV = o_BTHV.astype(o0_BTHV.dtype)
    if not return_final_state:
        return o_BTHV
    return o_BTHV, E_BHKV + jnp.einsum("bhij,bhjv->bhiv", A_BHKK, h0_BHKV, precision=_HI)
