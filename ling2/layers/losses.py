"""Token cross-entropy sums shared by the main loss, the MTP depths and evaluation.

Returns sums, not means, so gradient accumulation and MTP can normalise exactly once.

`cross_entropy_sums` takes logits [B, T, V]. `head_cross_entropy_sums` takes the final hidden
states and the output-head weight instead and never holds [B, T, V]: it walks the vocabulary
block by block (online logsumexp, running max and argmax) and its backward recomputes each
block's logits, so the loss needs O(B*T*V/num_blocks) memory instead of O(B*T*V).

Blocks are contiguous vocab ranges cut inside each of `vocab_shards` equal parts of the
vocabulary: with the head's vocab dim sharded that many ways (the tensor axis), block j is the
j-th range of every shard, so each device computes only its own columns and the per-token
max / sums are reduced across the shards; no weight moves between devices. Block widths are
rounded up to whole 128-column tiles; the last block of a shard ends at the shard's end and
skips the columns an earlier block already counted.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ling2.layers.embed import logits_einsum
from ling2.layers.sharding import constrain

F32 = jnp.float32
_LOGITS_NAMES = ("activation_batch", "activation_length", "activation_vocab")
_TILE = 128  # block widths are multiples of this (TPU lanes) when a block is wider


def cross_entropy_sums(logits_BTV, targets_BT, weights_BT):
    """(sum of weighted token CE, sum of weights, sum of weighted argmax hits), all fp32."""
    logits = logits_BTV.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    w = weights_BT.astype(jnp.float32)
    hits = (jnp.argmax(logits, -1) == targets_BT).astype(jnp.float32)
    return jnp.sum((lse - tgt) * w), jnp.sum(w), jnp.sum(hits * w)


def _constrain(logits, run):
    return logits if run is None else constrain(logits, _LOGITS_NAMES, run)


def head_logits(hidden_BTE, kernel, *, compute_dtype=None, logits_dtype=F32, tied=False, run=None):
    """Full logits [B, T, V] as LMHead (kernel [E, V]) or Embed.attend (tied: embedding [V, E]) make them;
    `run` (a RunSpec) shards them on its mesh."""
    cd = jnp.dtype(compute_dtype or hidden_BTE.dtype)
    spec = "bte,ve->btv" if tied else "bte,ev->btv"
    logits = logits_einsum(spec, hidden_BTE.astype(cd), kernel.astype(cd), jnp.dtype(logits_dtype))
    return _constrain(logits, run)


def head_cross_entropy_sums(hidden_BTE, kernel, targets_BT, weights_BT, *, num_blocks: int = 16,
                            vocab_shards: int = 1, compute_dtype=None, logits_dtype=F32, tied: bool = False,
                            run=None):
    """`cross_entropy_sums(head_logits(hidden, kernel, ...), targets, weights)` without the [B, T, V] logits.

    hidden_BTE: final (normed) hidden states [B, T, E].
    kernel: the untied lm_head kernel [E, V], or with tied=True the embedding [V, E].
    targets_BT: int token ids in [0, V); weights_BT: per-token loss weights (zeros allowed).
    num_blocks: blocks per vocab shard, each ceil(V / vocab_shards / num_blocks) ids rounded up to
      a multiple of 128 (so possibly fewer blocks); 0 computes the full logits instead.
    vocab_shards: how many ways the kernel's vocab dim is sharded (the tensor axis size under the
      default rules; 1 without a mesh). Any divisor of V gives the same numbers; the right one
      keeps every weight on its device.
    compute_dtype: dtype both matmul operands are cast to (cfg.dtype; default hidden's dtype);
    logits_dtype: the matmul's output dtype (fp32 with cfg.float32_logits), as in LMHead.
    run: the RunSpec whose mesh each block's logits are sharded on (None: no constraint).

    Returns (sum of weighted CE, sum of weights, sum of weighted argmax hits), fp32 scalars;
    the argmax takes the first (lowest) id among equal maxima, like jnp.argmax. Differentiable
    in hidden, kernel and weights; the backward recomputes the logits block by block.
    """
    name = "head_cross_entropy_sums"
    if hidden_BTE.ndim != 3 or kernel.ndim != 2:
        raise ValueError(f"{name}: hidden must be [B, T, E] and kernel 2-D, got {hidden_BTE.shape} and {kernel.shape}")
    E = hidden_BTE.shape[-1]
    V = kernel.shape[0] if tied else kernel.shape[1]
    if (kernel.shape[1] if tied else kernel.shape[0]) != E:
        raise ValueError(f"{name}: kernel {kernel.shape} does not match hidden size {E} "
                         f"({'[V, E] when tied' if tied else '[E, V] when untied'})")
    if targets_BT.shape != hidden_BTE.shape[:2] or weights_BT.shape != hidden_BTE.shape[:2]:
        raise ValueError(f"{name}: targets {targets_BT.shape} / weights {weights_BT.shape} must be "
                         f"{hidden_BTE.shape[:2]}")
    if vocab_shards < 1 or V % vocab_shards:
        raise ValueError(f"{name}: vocab_shards {vocab_shards} must divide vocab {V}")
    if not 0 <= num_blocks <= V // vocab_shards:
        raise ValueError(f"{name}: num_blocks must be in [0, {V // vocab_shards}] (vocab {V} / vocab_shards "
                         f"{vocab_shards}), got {num_blocks}")
    cd = jnp.dtype(compute_dtype or hidden_BTE.dtype)
    ld = jnp.dtype(logits_dtype)
    if num_blocks == 0:
        logits = head_logits(hidden_BTE, kernel, compute_dtype=cd, logits_dtype=ld, tied=tied, run=run)
        return cross_entropy_sums(logits, targets_BT, weights_BT)
    plan = _Plan.make(V, vocab_shards, num_blocks, tied, run)
    return _blocked(hidden_BTE, kernel, targets_BT, weights_BT, plan, cd, ld)


class _Plan(NamedTuple):
    """Static block layout: V ids in P shards of S, each walked in n blocks of c ids."""
    V: int
    P: int
    S: int
    c: int
    n: int
    tied: bool
    run: object  # RunSpec or None

    @classmethod
    def make(cls, V, P, num_blocks, tied, run=None):
        S = V // P
        c = -(-S // num_blocks)
        if c > _TILE:
            c = min(-(-c // _TILE) * _TILE, S)
        return cls(V, P, S, c, -(-S // c), tied, run)

    @property
    def axis(self):
        """The vocab axis of the kernel's [E, P, S] / [P, S, E] view."""
        return 1 if self.tied else 2

    def view(self, a, width=None):
        """A kernel-layout array with `width` (default S) ids per shard as [E, P, width] / [P, width, E]."""
        width = width or self.S
        return a.reshape(self.P, width, -1) if self.tied else a.reshape(-1, self.P, width)

    def start(self, j):
        """First in-shard id of block j; the last block ends at the shard's end."""
        return jnp.minimum(j * self.c, self.S - self.c)

    def block(self, w_view, j):
        """Block j's weight, [E, P*c] (untied) or [P*c, E] (tied)."""
        w = jax.lax.dynamic_slice_in_dim(w_view, self.start(j), self.c, axis=self.axis)
        return w.reshape(-1, w.shape[-1]) if self.tied else w.reshape(w.shape[0], -1)

    def ids(self, j):
        """(vocab ids [P*c], new [P*c]: not counted by an earlier block) of block j, in column order."""
        local = self.start(j) + jnp.arange(self.c, dtype=jnp.int32)
        ids = (jnp.arange(self.P, dtype=jnp.int32)[:, None] * self.S + local[None, :]).reshape(-1)
        return ids, jnp.tile(local >= j * self.c, self.P)

    @property
    def overlaps(self):
        return self.n * self.c != self.S


def _block_logits(x_BTE, w, new, plan, ld):
    """fp32 logits [B, T, P*c] of one block, -inf where an earlier block counted the id; x, w in compute dtype."""
    z = jnp.einsum("bte,ce->btc" if plan.tied else "bte,ec->btc", x_BTE, w, preferred_element_type=ld)
    z = _constrain(z, plan.run).astype(F32)
    return jnp.where(new, z, -jnp.inf) if plan.overlaps else z


def _forward_stats(x_BTE, kernel, targets_BT, plan, cd, ld):
    """Per-token (logsumexp, target logit, argmax id) over all vocab blocks."""
    kv = plan.view(kernel)
    x = x_BTE.astype(cd)
    tgt_ids = targets_BT.astype(jnp.int32)

    def body(carry, j):
        m, s, tgt, arg = carry
        ids, new = plan.ids(j)
        z = _block_logits(x, plan.block(kv, j).astype(cd), new, plan, ld)
        bm = jnp.max(z, axis=-1)
        barg = jnp.take(ids, jnp.argmax(z, axis=-1))
        take = (bm > m) | ((bm == m) & (barg < arg))
        m_new = jnp.maximum(m, bm)
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[..., None]), axis=-1)
        tgt = tgt + jnp.sum(jnp.where((ids == tgt_ids[..., None]) & new, z, 0.0), axis=-1)
        return (m_new, s, tgt, jnp.where(take, barg, arg)), None

    shape = targets_BT.shape
    init = (jnp.full(shape, -jnp.inf, F32), jnp.zeros(shape, F32), jnp.zeros(shape, F32),
            jnp.full(shape, plan.V, jnp.int32))
    (m, s, tgt, arg), _ = jax.lax.scan(body, init, jnp.arange(plan.n, dtype=jnp.int32))
    return m + jnp.log(s), tgt, arg


def _sums(lse, tgt, arg, targets_BT, weights_BT):
    w = weights_BT.astype(F32)
    hit = (arg == targets_BT).astype(F32)
    return (jnp.sum((lse - tgt) * w), jnp.sum(w), jnp.sum(hit * w)), hit


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blocked(x_BTE, kernel, targets_BT, weights_BT, plan, cd, ld):
    return _sums(*_forward_stats(x_BTE, kernel, targets_BT, plan, cd, ld), targets_BT, weights_BT)[0]


def _blocked_fwd(x_BTE, kernel, targets_BT, weights_BT, plan, cd, ld):
    lse, tgt, arg = _forward_stats(x_BTE, kernel, targets_BT, plan, cd, ld)
    out, hit = _sums(lse, tgt, arg, targets_BT, weights_BT)
    return out, (x_BTE, kernel, targets_BT, weights_BT, lse, tgt, hit)


def _blocked_bwd(plan, cd, ld, res, g):
    """d hidden accumulates over blocks in fp32; each block's d kernel lands in place in the kernel's layout.
    Casts follow `head_logits` (embed.logits_einsum): each block's logits cotangent is rounded to the compute
    dtype before its two GEMMs, d kernel is rounded to the compute dtype, then the kernel's."""
    x_BTE, kernel, targets_BT, weights_BT, lse, tgt, hit = res
    g_ce, g_n, g_hits = g
    kv = plan.view(kernel)
    x = x_BTE.astype(cd)
    tgt_ids = targets_BT.astype(jnp.int32)
    scale = g_ce * weights_BT.astype(F32)

    def body(carry, j):
        dx, dk = carry
        ids, new = plan.ids(j)
        w = plan.block(kv, j).astype(cd)
        z = _block_logits(x, w, new, plan, ld)
        dz = (jnp.exp(z - lse[..., None]) - ((ids == tgt_ids[..., None]) & new)) * scale[..., None]
        dz = _constrain(dz.astype(ld).astype(cd), plan.run)
        if plan.tied:
            dx = dx + jnp.einsum("btc,ce->bte", dz, w, preferred_element_type=F32)
            dw = jnp.einsum("bte,btc->ce", x, dz, preferred_element_type=F32)
        else:
            dx = dx + jnp.einsum("btc,ec->bte", dz, w, preferred_element_type=F32)
            dw = jnp.einsum("bte,btc->ec", x, dz, preferred_element_type=F32)
        dw = plan.view(dw.astype(cd).astype(kernel.dtype), plan.c)
        start = plan.start(j)
        if plan.overlaps:  # columns counted before have dw == 0 here: add, do not overwrite
            dw = dw + jax.lax.dynamic_slice_in_dim(dk, start, plan.c, axis=plan.axis)
        return (dx, jax.lax.dynamic_update_slice_in_dim(dk, dw, start, axis=plan.axis)), None

    (dx, dk), _ = jax.lax.scan(body, (jnp.zeros(x.shape, F32), jnp.zeros(kv.shape, kernel.dtype)),
                               jnp.arange(plan.n, dtype=jnp.int32))
    d_hidden = dx.astype(cd).astype(x_BTE.dtype)
    if jnp.issubdtype(weights_BT.dtype, jnp.inexact):
        d_weights = (g_ce * (lse - tgt) + g_n + g_hits * hit).astype(weights_BT.dtype)
    else:
        d_weights = np.zeros(weights_BT.shape, jax.dtypes.float0)
    return d_hidden, dk.reshape(kernel.shape), np.zeros(targets_BT.shape, jax.dtypes.float0), d_weights


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
