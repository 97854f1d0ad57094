"""Causal attention of one context shard's queries against the whole sequence's keys, with the causal work
balanced over the shards and memory linear in the sequence (context parallelism, non-splash backends).

With the sequence in N contiguous shards, shard i's queries see keys [0, (i+1) T/N): the last shard does
(2N-1)/N of the mean causal work. Cut the sequence into 2N chunks of C = T/2N instead and give device d the
chunks d and 2N-1-d (the zigzag layout Megatron-LM and MaxText use): each device then sees (d+1) + (2N-d)
= 2N+1 chunks of keys, the same on every device. The layers keep contiguous shards (GLA and KDA pass their
state along the sequence in order); only the queries of an MLA layer move, by two `ppermute`s of half a
shard each way:

  device i holds chunks 2i, 2i+1 -> chunk c goes to device c if c < N else 2N-1-c -> attention -> back.

On each device a scan walks the (2N+1) C / `block` key blocks its two chunks see, one [C, block] product a
step, with an online softmax (`zigzag_local`). Its custom VJP keeps only the output and the log-sum-exp
and recomputes each block's probabilities in the backward, so memory is O(T/N) per device beyond the keys
and values, not O(T/N x T). Segment ids are global (a document spanning shards keeps its id), so packed
documents mask as in `attention_mask`.
"""

import functools
import math

import jax
import jax.numpy as jnp

from ling2.kernels.attention.dense import NEG_INF
from ling2.kernels.vma import sum_like, vary_like

F32 = jnp.float32


def zigzag_chunks(n: int) -> list[tuple[int, int]]:
    """The two chunks (of 2n) each of n devices attends for, in the zigzag layout: device d holds d, 2n-1-d."""
    return [(d, 2 * n - 1 - d) for d in range(n)]


def key_blocks_per_device(n: int) -> list[int]:
    """Key chunks each device's queries see (its causal work in chunk x chunk units): 2n+1 everywhere."""
    return [(lo + 1) + (hi + 1) for lo, hi in zigzag_chunks(n)]


def zigzag_chunk(d, half, n: int):
    """The chunk (of 2n) device d attends for in its half `half` (0: the even one of {d, 2n-1-d}, 1: the odd
    one), the order `to_zigzag` puts them in. Integer arithmetic only: Python, numpy or jax ints."""
    par = d % 2
    even = d * (1 - par) + (2 * n - 1 - d) * par
    odd = (2 * n - 1 - d) * (1 - par) + d * par
    return even * (1 - half) + odd * half


def _dest(c: int, n: int) -> int:
    return c if c < n else 2 * n - 1 - c


def _permute(x, axis_name, pairs):
    return x if all(a == b for a, b in pairs) else jax.lax.ppermute(x, axis_name, pairs)


def _to_zigzag(x_half, parity: int, n: int, axis_name):
    """Chunks 2i + parity (one per device i) moved to the devices that attend for them."""
    return _permute(x_half, axis_name, [(i, _dest(2 * i + parity, n)) for i in range(n)])


def _from_zigzag(x_half, parity: int, n: int, axis_name):
    return _permute(x_half, axis_name, [(_dest(2 * i + parity, n), i) for i in range(n)])


def to_zigzag(x_BT_, axis_name):
    """Inside `shard_map`: this device's contiguous shard [B, T, ...] (chunks 2i, 2i+1) replaced by its zigzag
    chunks d and 2n-1-d, the even one first (what `ling2.kernels.attention.splash.zigzag_position` expects)."""
    n, C = jax.lax.axis_size(axis_name), x_BT_.shape[1] // 2
    return jnp.concatenate([_to_zigzag(x_BT_[:, :C], 0, n, axis_name), _to_zigzag(x_BT_[:, C:], 1, n, axis_name)],
                           axis=1)


def from_zigzag(x_BT_, axis_name):
    """The inverse of `to_zigzag`: results for the zigzag chunks moved back to the contiguous shards."""
    n, C = jax.lax.axis_size(axis_name), x_BT_.shape[1] // 2
    return jnp.concatenate([_from_zigzag(x_BT_[:, :C], 0, n, axis_name),
                            _from_zigzag(x_BT_[:, C:], 1, n, axis_name)], axis=1)


def balanced_context_attention(q_BTHK, k_BSHK, v_BSHV, q_segment_BT, kv_segment_BS, scale, *, axis_name,
                               block: int):
    """Inside `shard_map`: this device's contiguous shard of queries (shard i of n along `axis_name`, T = S/n
    positions, T even) against all S keys and values: o [B, T, H, V] in q's dtype, each query's causal
    same-document attention over the whole sequence. `block`: keys per scan step (its largest divisor of T/2)."""
    n = jax.lax.axis_size(axis_name)
    B, T, H, _ = q_BTHK.shape
    S = k_BSHK.shape[1]
    if T * n != S or T % 2:
        raise ValueError(f"balanced context attention: {n} shards of {T} queries must cover the {S} keys, "
                         "with an even number of queries per shard")
    C = T // 2
    block = math.gcd(min(block, C), C)
    d = jax.lax.axis_index(axis_name)
    chunk_2 = jnp.stack([zigzag_chunk(d, 0, n), zigzag_chunk(d, 1, n)])
    q_2BCHK = jnp.stack(jnp.split(to_zigzag(q_BTHK, axis_name), 2, axis=1))
    seg_2BC = jnp.stack(jnp.split(to_zigzag(q_segment_BT, axis_name), 2, axis=1))
    o_2BCHV = zigzag_local(q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_segment_BS, chunk_2, scale, C, block,
                           2 * n + 1)
    return from_zigzag(jnp.concatenate([o_2BCHV[0], o_2BCHV[1]], axis=1), axis_name).astype(q_BTHK.dtype)


def _steps(chunk_2, C: int, block: int, j):
    """Scan step j: (which of the two chunks, its key block): the lower chunk's (chunk+1) C / block blocks
    first, then the higher one's."""
    per = C // block
    lo = jnp.argmin(chunk_2)
    n_lo = (chunk_2[lo] + 1) * per
    first = j < n_lo
    which = jnp.where(first, lo, 1 - lo)
    kb = jnp.where(first, j, j - n_lo)
    return which, kb


def _block_scores(q_BCHK, k_BSHK, q_seg_BC, kv_seg_BS, chunk, kb, scale, C, block):
    """fp32 logits [B, H, C, block] of chunk `chunk`'s queries against key block kb, and their mask."""
    k_blk = jax.lax.dynamic_slice_in_dim(k_BSHK, kb * block, block, axis=1)
    seg_blk = jax.lax.dynamic_slice_in_dim(kv_seg_BS, kb * block, block, axis=1)
    s = jnp.einsum("bthk,bshk->bhts", q_BCHK, k_blk, preferred_element_type=F32) * scale
    q_idx = chunk * C + jnp.arange(C, dtype=jnp.int32)
    k_idx = kb * block + jnp.arange(block, dtype=jnp.int32)
    mask = (k_idx[None, :] <= q_idx[:, None])[None, None] & (seg_blk[:, None, None, :] == q_seg_BC[:, None, :, None])
    return jnp.where(mask, s, NEG_INF), mask, k_blk


def _forward(q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, scale, C, block, chunks_seen):
    B, _, H, _ = q_2BCHK.shape[1:]
    Vd = v_BSHV.shape[-1]
    m = vary_like(jnp.full((2, B, H, C), NEG_INF, F32), q_2BCHK)
    l = vary_like(jnp.zeros((2, B, H, C), F32), q_2BCHK)
    acc = vary_like(jnp.zeros((2, B, H, C, Vd), F32), q_2BCHK)

    def step(carry, j):
        m, l, acc = carry
        which, kb = _steps(chunk_2, C, block, j)
        q = jax.lax.dynamic_index_in_dim(q_2BCHK, which, keepdims=False)
        seg = jax.lax.dynamic_index_in_dim(seg_2BC, which, keepdims=False)
        s, _, _ = _block_scores(q, k_BSHK, seg, kv_seg_BS, chunk_2[which], kb, scale, C, block)
        v_blk = jax.lax.dynamic_slice_in_dim(v_BSHV, kb * block, block, axis=1)
        m_w, l_w, acc_w = (jax.lax.dynamic_index_in_dim(x, which, keepdims=False) for x in (m, l, acc))
        m_new = jnp.maximum(m_w, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m_w - m_new)
        l_new = alpha * l_w + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bhts,bshv->bhtv", p.astype(v_BSHV.dtype), v_blk, preferred_element_type=F32)
        acc_new = alpha[..., None] * acc_w + pv
        put = lambda x, new: jax.lax.dynamic_update_index_in_dim(x, new, which, 0)  # noqa: E731
        return (put(m, m_new), put(l, l_new), put(acc, acc_new)), None

    steps = chunks_seen * (C // block)
    (m, l, acc), _ = jax.lax.scan(step, (m, l, acc), jnp.arange(steps, dtype=jnp.int32))
    o_2BHCV = acc / l[..., None]
    lse_2BHC = m + jnp.log(l)
    return jnp.swapaxes(o_2BHCV, 2, 3), lse_2BHC


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def zigzag_local(q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, scale, C, block, chunks_seen):
    """Attention of two chunks of C queries (global chunk indices `chunk_2`, segment ids seg_2BC) against the
    keys before each chunk's end: o [2, B, C, H, V] fp32. The scan runs `chunks_seen` x C / block steps."""
    return _forward(q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, scale, C, block, chunks_seen)[0]


def _zigzag_fwd(q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, scale, C, block, chunks_seen):
    o, lse = _forward(q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, scale, C, block, chunks_seen)
    return o, (q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, o, lse)


def _zigzag_bwd(scale, C, block, chunks_seen, res, do_2BCHV):
    """The flash-attention backward, block by block: p recomputed from the saved log-sum-exp."""
    q_2BCHK, k_BSHK, v_BSHV, seg_2BC, kv_seg_BS, chunk_2, o, lse = res
    do = do_2BCHV.astype(F32)
    delta_2BHC = jnp.swapaxes(jnp.sum(do * o, axis=-1), 2, 3)
    dq, dk, dv = (vary_like(jnp.zeros(x.shape, F32), q_2BCHK) for x in (q_2BCHK, k_BSHK, v_BSHV))

    def step(carry, j):
        dq, dk, dv = carry
        which, kb = _steps(chunk_2, C, block, j)
        pick = lambda x: jax.lax.dynamic_index_in_dim(x, which, keepdims=False)  # noqa: E731
        q, seg, do_w, lse_w, delta_w = pick(q_2BCHK), pick(seg_2BC), pick(do), pick(lse), pick(delta_2BHC)
        s, mask, k_blk = _block_scores(q, k_BSHK, seg, kv_seg_BS, chunk_2[which], kb, scale, C, block)
        v_blk = jax.lax.dynamic_slice_in_dim(v_BSHV, kb * block, block, axis=1)
        p = jnp.where(mask, jnp.exp(s - lse_w[..., None]), 0.0)
        dv_blk = jnp.einsum("bhts,bthv->bshv", p, do_w)
        dp = jnp.einsum("bthv,bshv->bhts", do_w, v_blk.astype(F32))
        ds = p * (dp - delta_w[..., None]) * scale
        dq_w = jnp.einsum("bhts,bshk->bthk", ds, k_blk.astype(F32))
        dk_blk = jnp.einsum("bhts,bthk->bshk", ds, q.astype(F32))
        dq = jax.lax.dynamic_update_index_in_dim(dq, pick(dq) + dq_w, which, 0)
        add = lambda x, blk: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            x, jax.lax.dynamic_slice_in_dim(x, kb * block, block, axis=1) + blk, kb * block, axis=1)
        return (dq, add(dk, dk_blk), add(dv, dv_blk)), None

    steps = chunks_seen * (C // block)
    (dq, dk, dv), _ = jax.lax.scan(step, (dq, dk, dv), jnp.arange(steps, dtype=jnp.int32))
    zero = lambda x: None if x is None else jnp.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return (sum_like(dq, q_2BCHK).astype(q_2BCHK.dtype), sum_like(dk, k_BSHK).astype(k_BSHK.dtype),
            sum_like(dv, v_BSHV).astype(v_BSHV.dtype), zero(seg_2BC), zero(kv_seg_BS), zero(chunk_2))


zigzag_local.defvjp(_zigzag_fwd, _zigzag_bwd)
