"""The layout every chunked kernel works on, shared by the ops: document indices from segment ids, and
[B, T, H, D] inputs padded to whole chunks with heads first."""

import jax.numpy as jnp


def doc_index(segment_ids):
    """[B, T] non-decreasing document index: +1 wherever the segment id changes."""
    change_BT = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)  # [B, T-1]
    return jnp.concatenate([jnp.zeros_like(change_BT[:, :1]), jnp.cumsum(change_BT, axis=1)], axis=1)


def prepare(x_BTHD, C):
    """Pads T to a multiple of C and moves heads first: [B, T, H, D] -> [B, H, L, D]."""
    pad = -x_BTHD.shape[1] % C
    return jnp.pad(x_BTHD, ((0, 0), (0, pad), (0, 0), (0, 0))).swapaxes(1, 2)
