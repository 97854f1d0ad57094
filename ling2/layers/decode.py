"""Decode caches: the bookkeeping every cached layer shares.

A cache of B rows and S slots holds, besides each layer's own tensors (MLA: the latent
c_kv and k_rope per slot; GLA: the recurrent state),
  index   [B] int32: the slot the next token of each row goes to (rows advance independently);
  segment [B,S] int32: the document id held by each slot, 0 for empty or padding.
A call with T new tokens writes them to slots index..index+T-1 of their row. A query at slot
s sees the slots <= s that hold its own segment id, so left padding (segment 0), packed
documents (distinct ids) and stale slots past `index` (always in a query's future, and
overwritten before they are read) are never attended to. Rolling a row back (speculative
decoding) is only moving its `index` back (and restoring its GLA states).
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class DecodeState(NamedTuple):
    """What a layer needs to know about one cached call (built by `begin`)."""

    index_B: jax.Array  # [B] int32 slot of each row's first new token
    segment_BS: jax.Array  # [B,S] int32 segment id of every slot after this call's write
    fresh: bool = False  # the rows' caches are empty: attend among the new tokens only (prefill)
    absorb: bool = True  # MLA: attention in the latent space (else K/V expanded from the latents)
    token_states: bool = False  # GLA: also return the state after every new token [B,T,H,K,V]
    packed_docs: int = 0  # GLA, fresh prefill: also return each row's first N documents' end states


def empty(batch: int, max_len: int) -> dict:
    """The shared part of an empty cache: {"index": [B], "segment": [B,S]}."""
    return {"index": jnp.zeros((batch,), jnp.int32), "segment": jnp.zeros((batch, max_len), jnp.int32)}


def write_rows(buf_BS_, new_BT_, index_B):
    """buf with new[b] written at slots index[b].. of row b (any trailing dims)."""
    put = lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype), i, 0)  # noqa: E731
    return jax.vmap(put)(buf_BS_, new_BT_, index_B)


def begin(cache: dict, segment_ids_BT, **flags) -> DecodeState:
    """The DecodeState of a call writing segment_ids_BT [B,T] (nonzero for real tokens) at cache["index"]."""
    return DecodeState(cache["index"], write_rows(cache["segment"], segment_ids_BT, cache["index"]), **flags)


def end(state: DecodeState, T: int, layers: dict) -> dict:
    """The cache after a call of T tokens whose layers returned `layers`."""
    return {"index": state.index_B + T, "segment": state.segment_BS, "layers": layers}


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


def rollback(cache: dict, index_B, gla_states: Optional[dict] = None) -> dict:
    """`cache` with each row's next slot moved to index_B and, for every GLA layer i in gla_states,
    its state replaced by gla_states[i] [B,H,K,V]."""
    layers = dict(cache["layers"])
    for i, s in (gla_states or {}).items():
        layers[i] = {**layers[i], "state": s}
    return {**cache, "index": index_B, "layers": layers}
