"""Cached decoding: the interface every attention kind implements, and the bookkeeping they share.

Training runs `layer(x, positions, segment_ids)` and nothing here. Decoding is separate, per
attention kind, over a typed cache pytree defined beside the module (MLACache, GLACache, KDACache):
  init_cache(batch, max_len)                          -> an empty cache of the kind
  prefill(x, positions, segment_ids, cache, state, opts) -> (out, cache)  fresh rows: attend among the new tokens
  step(x, positions, segment_ids, cache, state, opts)    -> (out, cache)  continue every row from its cache
  accept(old, new, keep_B, live_B)                    -> cache  after a step with opts.history: each live
                                                          row as after its token keep_B (speculative rollback)
  unpack(packed, empty, gather)                       -> cache  documents of packed rows moved to rows of their own

A decoder cache (`DecoderCache`) of B rows and S slots holds, besides each layer's cache,
  index   [B] int32: the slot the next token of each row goes to (rows advance independently);
  segment [B,S] int32: the document id held by each slot, 0 for empty or padding.
A call with T new tokens writes them to slots index..index+T-1 of their row. A query at slot
s sees the slots <= s that hold its own segment id, so left padding (segment 0), packed
documents (distinct ids) and stale slots past `index` (always in a query's future, and
overwritten before they are read) are never attended to. Rolling a row back (speculative
decoding) is moving its `index` back and `accept`ing each layer's state.
"""

from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import struct


@runtime_checkable
class CachedAttention(Protocol):
    """What every attention kind implements for cached decoding (the module docstring's table); a kind that
    cannot unpack packed rows says so by its registry entry's `packed_prefill` and raises in `unpack`."""

    def init_cache(self, batch: int, max_len: int) -> Any: ...

    def prefill(self, x_BTE, positions_BT, segment_ids_BT, cache, state: "DecodeState", opts: "DecodeOptions", *,
                layer_index=None) -> tuple[jax.Array, Any]: ...

    def step(self, x_BTE, positions_BT, segment_ids_BT, cache, state: "DecodeState", opts: "DecodeOptions", *,
             layer_index=None) -> tuple[jax.Array, Any]: ...

    def accept(self, old, new, keep_B, live_B) -> Any: ...

    def unpack(self, packed, empty, gather: "Gather") -> Any: ...


class DecodeState(NamedTuple):
    """Where one cached call's tokens go (built by `begin`)."""

    index_B: jax.Array  # [B] int32 slot of each row's first new token
    segment_BS: jax.Array  # [B,S] int32 segment id of every slot after this call's write


class DecodeOptions(NamedTuple):
    """What a cached call asks of the layers (each kind reads what applies to it)."""

    absorb: bool = True  # MLA step: attention in the latent space (else K/V expanded from the latents)
    history: bool = False  # recurrent step: keep the state after every new token, for `accept`
    packed_docs: int = 0  # GLA prefill: also keep each row's first N documents' end states, for `unpack`


@struct.dataclass
class DecoderCache:
    """A decoder's cache: the shared bookkeeping and {layer index: the layer's cache}; an MTP depth's holds its
    one layer's cache as `layers`."""

    index: jax.Array  # [B] int32
    segment: jax.Array  # [B, S] int32
    layers: Any


def empty(batch: int, max_len: int, layers: dict) -> DecoderCache:
    return DecoderCache(jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, max_len), jnp.int32), layers)


def write_rows(buf_BS_, new_BT_, index_B):
    """buf with new[b] written at slots index[b].. of row b (any trailing dims)."""
    put = lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, 0)  # noqa: E731
    return jax.vmap(put)(buf_BS_, new_BT_, index_B)


def begin(cache: DecoderCache, segment_ids_BT) -> DecodeState:
    """The DecodeState of a call writing segment_ids_BT [B,T] (nonzero for real tokens) at cache.index."""
    return DecodeState(cache.index, write_rows(cache.segment, segment_ids_BT, cache.index))


def end(state: DecodeState, T: int, layers: dict) -> DecoderCache:
    """The cache after a call of T tokens whose layers returned `layers`."""
    return DecoderCache(state.index_B + T, state.segment_BS, layers)


def attention_mask(state: DecodeState, segment_ids_BT) -> jax.Array:
    """[B,T,S] bool: slot s is visible to new token t when s <= its own slot and holds its segment."""
    B, T = segment_ids_BT.shape
    S = state.segment_BS.shape[1]
    q_slot_BT = state.index_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    causal = jnp.arange(S, dtype=jnp.int32)[None, None, :] <= q_slot_BT[:, :, None]
    return causal & (state.segment_BS[:, None, :] == segment_ids_BT[:, :, None])


def overflow_to_nan(out_BT_, state: DecodeState, T: int, S: int):
    """NaN rows where the write ran past the cache (dynamic_update_slice would clamp it silently)."""
    ok = state.index_B + T <= S
    return jnp.where(ok.reshape((-1,) + (1,) * (out_BT_.ndim - 1)), out_BT_, jnp.nan)


def take_rows(x_BT_, i_B):
    """x[b, i[b]] for every row."""
    return jnp.take_along_axis(x_BT_, i_B.reshape((-1, 1) + (1,) * (x_BT_.ndim - 2)), axis=1)[:, 0]


def where_rows(live_B, new_B_, old_B_):
    """new where the row is live, else old (any trailing dims)."""
    return jnp.where(live_B.reshape((-1,) + (1,) * (new_B_.ndim - 1)), new_B_, old_B_)


class Gather(NamedTuple):
    """Where each slot of the padded layout [B, T] takes its values from in packed rows [R, L]:
    `row`, `col` (-1: padding) and each prompt's packed row and document number `doc` [B, 2]."""

    row: jax.Array
    col: jax.Array
    doc: jax.Array


def move_slots(x_RL_, g: Gather):
    """[B, T, ...] values of packed slots placed at the padded layout's slots (zeros for padding)."""
    valid = g.row >= 0
    y = x_RL_[jnp.maximum(g.row, 0), jnp.maximum(g.col, 0)]
    return jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), y, 0)
