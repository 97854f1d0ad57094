"""Gated linear attention layer of Ling2 (BailingMoeV2_5 linear attention), Flax NNX.

  [q | k | v] = x W_qkv                       [B,T,3,H,D]  (SiLU when use_linear_silu)
  q, k = RoPE(RMSNorm_D(q)), RoPE(RMSNorm_D(k))   partial NeoX rotary on the first rotary_dim dims
  o = simple_gla(q, k, v, g = -slope_h)       state resets at each new segment id
  out = (GroupRMSNorm(o as [B,T,H*D]) * sigmoid(x W_g)) W_dense          [B,T,E]

Slopes are ALiBi-style per head, scaled per layer (`layer_slopes`); they are constants,
not parameters. Under a mesh (`sharding.use_mesh`) the kernel runs inside `shard_map`,
batch split by the `activation_batch` rule and heads by `activation_heads`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ling2.kernels import gla
from ling2.layers import norms, rope, sharding, yarn


def alibi_base_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes [H] float64: start^(h+1), start = 2^(-2^-(log2 H - 3)) for H a power of two;
    otherwise those of the closest smaller power of two, then every other slope of twice that."""

    def pow2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (h + 1) for h in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return np.asarray(pow2(num_heads))
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    return np.asarray(pow2(closest) + pow2(2 * closest)[0::2][:num_heads - closest])


def layer_slopes(num_heads: int, layer_idx: int, num_layers: int, offset: int = -1) -> np.ndarray:
    """Decay rates [H] of one layer: base_h * (1 - (layer_idx + offset) / (L - 1) + 1e-5).

    offset -1 is the HF reference's (layer_idx - 1) with 0-indexed layer_idx; 0 is vLLM's.
    """
    if num_layers < 2:
        raise ValueError(f"num_decoder_layers={num_layers}: GLA slopes need at least 2 layers")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx={layer_idx} outside [0, {num_layers})")
    return alibi_base_slopes(num_heads) * (1 - (layer_idx + offset) / (num_layers - 1) + 1e-5)


def matmul_params(cfg) -> int:
    """Weights a token is multiplied by: qkv, g_proj and dense."""
    return 5 * cfg.emb_dim * cfg.num_query_heads * cfg.head_dim


def mixing_flops(cfg, seq_len: int) -> float:
    """Forward token-mixing FLOPs per token (chunked, chunk C): per head the state read q.S and
    update k^T v (4 D^2) plus the causal intra-chunk scores and their product with v (2 D C)."""
    H, D = cfg.num_query_heads, cfg.head_dim
    return H * (4 * D * D + 2 * D * min(cfg.gla_chunk_size, seq_len))


class GatedLinearAttention(nnx.Module):
    """Ling2 linear-attention layer. Call with x [B,T,E], positions [B,T], optional segment_ids [B,T]."""

    def __init__(self, cfg, layer_idx: int, *, rngs: nnx.Rngs):
        E, H, D = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim
        self.H, self.D, self.layer_idx = H, D, layer_idx
        wdt = jnp.dtype(cfg.weight_dtype)
        init = nnx.initializers.normal(cfg.init_std)

        def param(shape, names):
            return nnx.Param(init(rngs.params(), shape, wdt), out_sharding=names, eager_sharding=False)

        self.qkv = param((E, 3, H, D), ("embed", None, "heads", "kv"))
        self.g_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.dense = param((H, D, E), ("heads", "kv", "embed"))
        eps = cfg.normalization_layer_epsilon
        self.use_qk_norm, self.use_silu = cfg.use_qk_norm, cfg.use_linear_silu
        if self.use_qk_norm:
            self.q_norm = norms.RMSNorm(D, eps=eps, param_dtype=wdt)
            self.k_norm = norms.RMSNorm(D, eps=eps, param_dtype=wdt)
        self.g_norm = norms.GroupRMSNorm(H * D, cfg.group_norm_size, eps=eps, param_dtype=wdt)
        self.rotary_dim = cfg.rotary_dim
        self.inv_freq = tuple(float(f) for f in yarn.rope_inv_freq(cfg))
        self.rope_scaling = yarn.rope_attention_scaling(cfg)
        slopes = layer_slopes(H, layer_idx, cfg.num_decoder_layers, cfg.gla_slope_layer_offset)
        self.log_decay = tuple(float(-s) for s in slopes)  # g_h = -slope_h, a constant
        self.dtype, self.chunk_size, self.backend = cfg.dtype, cfg.gla_chunk_size, cfg.gla_backend
        self.rules = sharding.rules_dict(cfg.logical_axis_rules)

    def init_cache(self, batch: int):
        """Decode cache: the fp32 recurrent state [B, H, D, D] (one document per row)."""
        return {"state": jnp.zeros((batch, self.H, self.D, self.D), jnp.float32)}

    def _w(self, p):
        return p[...].astype(jnp.dtype(self.dtype))

    def _kernel(self, q, k, v, g, seg, h0):
        """simple_gla (h0 None: zero state, no state gradient); under a mesh inside shard_map with batch
        and heads split (g per token, so every input is split the same way and its gradient stays local)."""
        def run(q, k, v, g, seg, *h0):
            return gla.simple_gla(q, k, v, g, segment_ids=seg, initial_state=h0[0] if h0 else None,
                                  chunk_size=self.chunk_size, backend=self.backend, return_final_state=True)

        state = () if h0 is None else (h0,)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            return run(q, k, v, g, seg, *state)
        spec = sharding.logical_to_spec(("activation_batch", None, "activation_heads", None), q.shape, self.rules, mesh)
        bt, ht = spec[0], spec[2]
        g = jnp.broadcast_to(g, q.shape[:3])
        state_spec = P(bt, ht, None, None)
        specs = (spec, spec, spec, P(bt, None, ht), P(bt, None)) + (state_spec,) * len(state)
        # check_vma=False: Pallas kernels inside do not annotate how their outputs vary over the mesh.
        return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=(spec, state_spec), check_vma=False)(
            q, k, v, g, seg, *state)

    def __call__(self, x_BTE, positions_BT, segment_ids_BT=None, cache=None, log_decay=None, decode=None):
        """Returns out [B,T,E] (and the updated cache when one is given).

        `log_decay`: optional [H] log-decays replacing this layer's own constants (a scanned
        decoder passes each layer's as a scanned-over value). With a cache, `decode` (a
        `ling2.layers.decode.DecodeState`; None: prefill unless T == 1) picks the chunked kernel
        from the cached state (prefill; segment ids reset it, so left padding never reaches a
        row's document) or one recurrence step per token (decode)."""
        B, T, _ = x_BTE.shape
        x = x_BTE.astype(jnp.dtype(self.dtype))
        qkv = jnp.einsum("bte,eshd->btshd", x, self._w(self.qkv))
        if self.use_silu:
            qkv = jax.nn.silu(qkv)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, D]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.apply_rotary(q, positions_BT, self.rotary_dim, inv_freq=self.inv_freq, scaling=self.rope_scaling)
        k = rope.apply_rotary(k, positions_BT, self.rotary_dim, inv_freq=self.inv_freq, scaling=self.rope_scaling)
        names = ("activation_batch", "activation_length", "activation_heads", None)
        q, k, v = (sharding.constrain(a, names) for a in (q, k, v))
        g = jnp.asarray(self.log_decay if log_decay is None else log_decay, jnp.float32)
        if segment_ids_BT is None:
            segment_ids_BT = jnp.zeros((B, T), jnp.int32)
        h0 = None if cache is None else cache["state"]
        new = {}
        if cache is not None and (T == 1 if decode is None else not decode.fresh):
            o, states = [], []
            hT = h0
            for t in range(T):
                o_t, hT = gla.simple_gla_step(hT, q[:, t], k[:, t], v[:, t], g)
                o.append(o_t)
                states.append(hT)
            o = jnp.stack(o, axis=1)
            if decode is not None and decode.token_states:
                new["states"] = jnp.stack(states, axis=1)
        else:
            o, hT = self._kernel(q, k, v, g, segment_ids_BT, h0)
            if decode is not None and decode.packed_docs:
                new["doc_states"] = gla.segment_end_states(k, v, g, segment_ids_BT, decode.packed_docs)
        o = sharding.constrain(o, names)
        o = self.g_norm(o.reshape(B, T, self.H * self.D)).reshape(B, T, self.H, self.D)
        gate = jax.nn.sigmoid(jnp.einsum("bte,ehd->bthd", x, self._w(self.g_proj)).astype(jnp.float32))
        o = (o.astype(jnp.float32) * gate).astype(x.dtype)
        out = jnp.einsum("bthd,hde->bte", o, self._w(self.dense))
        out = sharding.constrain(out, ("activation_batch", "activation_length", "activation_embed"))
        return out if cache is None else (out, {"state": hT, **new})
