"""Gated linear attention layer of Ling2 (BailingMoeV2_5 linear attention), Flax NNX.

  [q | k | v] = x W_qkv                       [B,T,3,H,D]  (SiLU when use_linear_silu)
  q, k = RoPE(RMSNorm_D(q)), RoPE(RMSNorm_D(k))   partial NeoX rotary on the first rotary_dim dims
  o = simple_gla(q, k, v, g = -slope_h)       state resets at each new segment id
  out = (GroupRMSNorm(o as [B,T,H*D]) * sigmoid(x W_g)) W_dense          [B,T,E]

Slopes are ALiBi-style per head, scaled per layer (`layer_slopes`); they are constants,
not parameters. On a mesh (the spec's `run.mesh_shape`) the kernel runs inside `shard_map`,
batch split by the `activation_batch` rule and heads by `activation_heads`; with the sequence
split by `activation_length` (a context axis) each device runs its shard through
`simple_gla_cp`, which passes the state across shard edges.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ling2.config.specs import GLASpec
from ling2.kernels import gla
from ling2.layers import norms, rope, sharding, yarn
from ling2.kernels import fp8
from ling2.layers.attention.decode import take_rows, where_rows

BTHD = ("activation_batch", "activation_length", "activation_heads", None)
BTHD_KERNEL = ("activation_batch", None, "activation_heads", None)  # time whole inside the kernel's shard_map
BHKV = ("activation_batch", "activation_heads", None, None)


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


def matmul_params(spec: GLASpec) -> int:
    """Weights a token is multiplied by: qkv, g_proj and dense."""
    return 5 * spec.emb_dim * spec.num_query_heads * spec.head_dim


def mixing_flops(spec: GLASpec, seq_len: int) -> float:
    """Forward token-mixing FLOPs per token (chunked, chunk C): per head the state read q.S and
    update k^T v (4 D^2) plus the causal intra-chunk scores and their product with v (2 D C)."""
    H, D = spec.num_query_heads, spec.head_dim
    return H * (4 * D * D + 2 * D * min(spec.run.gla_chunk_size, seq_len))


def hf_params(layout: str) -> list[tuple]:
    """(HF tensor suffix in a layer, state sub-path, nin, aliases) of this layer's weights
    (`ling2.convert.mapping.Entry`)."""
    return [("attention.query_key_value.weight", ("attention", "qkv"), 1, ()),
            ("attention.g_proj.weight", ("attention", "g_proj"), 1, ()),
            ("attention.g_norm.weight", ("attention", "g_norm", "weight"), 0, ()),
            ("attention.query_layernorm.weight", ("attention", "q_norm", "weight"), 0, ()),
            ("attention.key_layernorm.weight", ("attention", "k_norm", "weight"), 0, ()),
            ("attention.dense.weight", ("attention", "dense"), 2, ())]


class GatedLinearAttention(nnx.Module):
    """Ling2 linear-attention layer. Call with x [B,T,E], positions [B,T], optional segment_ids [B,T]."""

    def __init__(self, spec: GLASpec, *, rngs: nnx.Rngs):
        E, H, D = spec.emb_dim, spec.num_query_heads, spec.head_dim
        self.H, self.D = H, D
        wdt = jnp.dtype(spec.weight_dtype)
        init = nnx.initializers.normal(spec.init_std)

        def param(shape, names):
            return nnx.Param(init(rngs.params(), shape, wdt), out_sharding=names, eager_sharding=False)

        self.qkv = param((E, 3, H, D), ("embed", None, "heads", "kv"))
        self.g_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.dense = param((H, D, E), ("heads", "kv", "embed"))
        eps = spec.normalization_layer_epsilon
        self.use_qk_norm, self.use_silu = spec.use_qk_norm, spec.use_linear_silu
        if self.use_qk_norm:
            self.q_norm = norms.RMSNorm(D, eps=eps, param_dtype=wdt)
            self.k_norm = norms.RMSNorm(D, eps=eps, param_dtype=wdt)
        self.g_norm = norms.GroupRMSNorm(H * D, spec.group_norm_size, eps=eps, param_dtype=wdt)
        self.rotary_dim = spec.rotary_dim
        self.inv_freq = tuple(float(f) for f in yarn.rope_inv_freq(spec))
        self.rope_scaling = yarn.rope_attention_scaling(spec)
        L = spec.num_decoder_layers
        self.log_decays = tuple(tuple(float(-s) for s in layer_slopes(H, i, L, spec.gla_slope_layer_offset))
                                for i in range(L))  # g_h = -slope_h of every layer index: constants
        self.dtype, self.chunk_size, self.backend = spec.dtype, spec.run.gla_chunk_size, spec.run.gla_backend
        self.fp8 = fp8.of(spec.run)
        self.run = spec.run

    def _w(self, p):
        return p[...].astype(jnp.dtype(self.dtype))

    def _kernel(self, q, k, v, g, seg, h0):
        """simple_gla (h0 None: zero state, no state gradient); under a mesh inside shard_map with batch
        and heads split (g per head [H] or per token [B, T, H]). With the sequence split over a context
        axis, each device runs its shard by `simple_gla_cp` (training only: no initial or final state)."""
        g_names = ("activation_heads",) if g.ndim == 1 else ("activation_batch", "activation_length",
                                                                "activation_heads")
        cp = sharding.context_axes(self.run, q.shape[1], "gla")
        if cp is not None:
            if h0 is not None:
                raise ValueError("gla: context parallelism splits training sequences; cached decoding (an initial "
                                 "state) runs with the context axis of size 1")

            def run_cp(q, k, v, g, seg):
                return gla.simple_gla_cp(q, k, v, g, axis_name=cp, segment_ids=seg, chunk_size=self.chunk_size,
                                         backend=self.backend)

            names = (BTHD, BTHD, BTHD, g_names, ("activation_batch", "activation_length"))
            return sharding.shard_map_for(self.run, run_cp, names, BTHD)(q, k, v, g, seg), None

        def run(q, k, v, g, seg, *h0):
            return gla.simple_gla(q, k, v, g, segment_ids=seg, initial_state=h0[0] if h0 else None,
                                  chunk_size=self.chunk_size, backend=self.backend, return_final_state=True)

        state = () if h0 is None else (h0,)
        g_names = tuple(None if n == "activation_length" else n for n in g_names)
        names = (BTHD_KERNEL, BTHD_KERNEL, BTHD_KERNEL, g_names, ("activation_batch", None))
        return sharding.shard_map_for(self.run, run, names + (BHKV,) * len(state), (BTHD_KERNEL, BHKV))(
            q, k, v, g, seg, *state)

    def _qkv(self, x_BTE, positions_BT):
        """(x in the compute dtype, q, k, v [B,T,H,D] with qk-norm and RoPE)."""
        x = x_BTE.astype(jnp.dtype(self.dtype))
        qkv = fp8.einsum("bte,eshd->btshd", x, self._w(self.qkv), self.fp8)
        if self.use_silu:
            qkv = jax.nn.silu(qkv)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, D]
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope.apply_rotary(q, positions_BT, self.rotary_dim, inv_freq=self.inv_freq, scaling=self.rope_scaling)
        k = rope.apply_rotary(k, positions_BT, self.rotary_dim, inv_freq=self.inv_freq, scaling=self.rope_scaling)
        q, k, v = (sharding.constrain(a, BTHD, self.run) for a in (q, k, v))
        return x, q, k, v

    def _out(self, x, o_BTHD):
        """Group norm, the output gate and the dense projection: [B,T,E]."""
        B, T = o_BTHD.shape[:2]
        o = sharding.constrain(o_BTHD, BTHD, self.run)
        o = self.g_norm(o.reshape(B, T, self.H * self.D)).reshape(B, T, self.H, self.D)
        gate = jax.nn.sigmoid(fp8.einsum("bte,ehd->bthd", x, self._w(self.g_proj), self.fp8).astype(jnp.float32))
        o = (o.astype(jnp.float32) * gate).astype(x.dtype)
        out = fp8.einsum("bthd,hde->bte", o, self._w(self.dense), self.fp8)
        return sharding.constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.run)

    def decay(self, layer_index):
        """The layer's fp32 log-decays [H]; `layer_index` may be traced (a layer of a scanned group)."""
        if isinstance(layer_index, int) and not 0 <= layer_index < len(self.log_decays):
            raise ValueError(f"gla: layer_index={layer_index} outside [0, {len(self.log_decays)})")
        return jnp.asarray(np.asarray(self.log_decays, np.float32))[layer_index]

    def __call__(self, x_BTE, positions_BT, segment_ids_BT=None, *, layer_index):
        """Training forward: out [B,T,E], the state restarting at every segment. `layer_index`: the layer's
        global index, which sets its decays (traced under scan)."""
        B, T, _ = x_BTE.shape
        x, q, k, v = self._qkv(x_BTE, positions_BT)
        if segment_ids_BT is None:
            segment_ids_BT = jnp.zeros((B, T), jnp.int32)
        o, _ = self._kernel(q, k, v, self.decay(layer_index), segment_ids_BT, None)
        return self._out(x, o)

    # ---- cached decoding (ling2.layers.attention.decode) ----

    def init_cache(self, batch: int, max_len: int) -> "GLACache":
        """The fp32 recurrent state [B, H, D, D] (one document per row; max_len is not needed)."""
        return GLACache(jnp.zeros((batch, self.H, self.D, self.D), jnp.float32))

    def prefill(self, x_BTE, positions_BT, segment_ids_BT, cache, state, opts, *, layer_index):
        """The chunked kernel from the cached state (segment ids reset it, so left padding never reaches a
        row's document); with opts.packed_docs also each row's first documents' end states."""
        x, q, k, v = self._qkv(x_BTE, positions_BT)
        g = self.decay(layer_index)
        o, hT = self._kernel(q, k, v, g, segment_ids_BT, cache.state_BHKV)
        docs = gla.segment_end_states(k, v, g, segment_ids_BT, opts.packed_docs) if opts.packed_docs else None
        return self._out(x, o), GLACache(hT, docs_BNHKV=docs)

    def step(self, x_BTE, positions_BT, segment_ids_BT, cache, state, opts, *, layer_index):
        """One recurrence step per new token; with opts.history also the state after each."""
        T = x_BTE.shape[1]
        x, q, k, v = self._qkv(x_BTE, positions_BT)
        g = self.decay(layer_index)
        o, states, hT = [], [], cache.state_BHKV
        for t in range(T):
            o_t, hT = gla.simple_gla_step(hT, q[:, t], k[:, t], v[:, t], g)
            o.append(o_t)
            states.append(hT)
        history = jnp.stack(states, axis=1) if opts.history else None
        return self._out(x, jnp.stack(o, axis=1)), GLACache(hT, history_BTHKV=history)

    def accept(self, old, new, keep_B, live_B):
        """Each live row's state after its new token keep_B; other rows keep the old state."""
        return GLACache(where_rows(live_B, take_rows(new.history_BTHKV, keep_B), old.state_BHKV))

    def unpack(self, packed, empty, gather):
        """Each prompt's state: the end state of its document in its packed row."""
        return GLACache(packed.docs_BNHKV[gather.doc[:, 0], gather.doc[:, 1]])


@struct.dataclass
class GLACache:
    """The fp32 recurrent state [B, H, D, D]; after a step with opts.history the state after every new token
    [B, T, H, D, D]; after a prefill with opts.packed_docs each row's documents' end states [B, N, H, D, D]."""

    state_BHKV: jax.Array
    history_BTHKV: jax.Array | None = None
    docs_BNHKV: jax.Array | None = None
