"""Multi-head latent attention (DeepSeek-V3 style), the full-attention layer of Ling2.

  q = W_qb RMSNorm(W_qa x)          (or q = W_q x when q_lora_rank == 0)   [B,T,H,nope+rope]
  [c_kv | k_rope] = W_kva x          c_kv [B,T,kv_lora], k_rope [B,T,rope] shared by heads
  [k_nope | v] = W_kvb RMSNorm(c_kv)                                      [B,T,H,nope+v]
  o = softmax(q.k * scale + mask) v;  out = W_dense o                     [B,T,E]
  with mla_output_gate (Ling 3): o[b,t,h] *= sigmoid(x W_g)[b,t,h] before W_dense, W_g [E,H]

The rope part of q and k gets NeoX rotate-half RoPE; with `mla_interleaved_rope` its dims
are first reordered (even, then odd), as the reference's interleaved weights expect. The
mask is causal within the row AND equal segment id (packed documents never see each
other). The softmax attention itself is `ling2.kernels.attention` with cfg.attention_kernel as its
backend ("dot_product", "blocked", "cudnn", "flash"); with the sequence split over a context axis the
latents are all-gathered and each device attends its own queries (`_attend_context`).
Decoding (`ling2.layers.attention.decode`'s interface) keeps a latent KV cache (`MLACache`: normed c_kv
and rotated k_rope per slot) and steps in the absorbed form: q_nope mapped into the latent space by kv_b's
key half, scores and the weighted sum taken against the latents, then kv_b's value half (`MLA.absorbed`);
writing past the cache's end turns the output into NaN.
"""

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ling2.config.specs import MLASpec
from ling2.layers import norms, rope, sharding, yarn
from ling2.kernels import attention as attention_ops
from ling2.kernels import fp8
from ling2.kernels.attention.context import balanced_context_attention, from_zigzag, to_zigzag
from ling2.kernels.attention.dense import NEG_INF
from ling2.kernels.attention.splash import zigzag_causal_mask
from ling2.layers.attention.decode import attention_mask as decode_mask
from ling2.layers.attention.decode import move_slots, overflow_to_nan, write_rows
from ling2.layers.sharding import constrain

# The reference's q_a_layernorm / kv_a_layernorm use eps 1e-6 whatever the config says.
LORA_NORM_EPS = 1e-6


def deinterleave(x):
    """Reorders the last dim as (even indices, then odd): the reference's interleaved rope layout."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def splash_context_attention(q_BTHK, k_BSHK, v_BSHV, segment_BT, scale, run, *, interpret=None, block=512):
    """Splash attention with the queries split over the context axis and the keys whole on every device
    (on the mesh of `run`, a RunSpec). The queries move to the zigzag layout (`to_zigzag`: device d holds
    chunks d and 2n-1-d of 2n), and one kernel takes the whole [T, T] causal mask with its rows in that order
    (`zigzag_causal_mask`) and `q_seq_shards` = the context size; its mask blocks split with the queries
    (`manual_sharding_spec`), so each device skips the blocks above the diagonal of its own rows and every
    device does the same causal work. Needs T / (2 x context) to be a multiple of the block."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, T, H, _ = q_BTHK.shape
    mesh = sharding.mesh_of(run)
    heads, seq = sharding.dim_axes(run, "activation_heads", H), sharding.dim_axes(run, "activation_length", T)
    head_shards, n = sharding.dim_shards(run, "activation_heads", H), sharding.dim_shards(run, "activation_length", T)
    C = T // (2 * n)
    bq, bkv = min(block, C), min(block, T)
    if T % (2 * n) or C % bq or bq % 128 or T % bkv or T % (n * n):
        raise ValueError(f"attention_kernel=flash: half a context shard ({T} / 2 x {n} positions) must be a "
                         f"multiple of the block {bq} and of 128, the sequence ({T}) of {bkv} and of {n} x {n}")
    sizes = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    mask = sm.MultiHeadMask([zigzag_causal_mask(T, n) for _ in range(H)])
    axis = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis(heads), axis(seq)))
    BTHD, BSHD = ("activation_batch", "activation_length", "activation_heads", None), ("activation_batch", None,
                                                                                       "activation_heads", None)

    def body(kernel, q, k, v, q_seg, kv_seg):
        q, q_seg = to_zigzag(q, axis(seq)), to_zigzag(q_seg, axis(seq))
        attend = lambda q1, k1, v1, s1, s2: kernel(q1, k1, v1, segment_ids=sk.SegmentIds(q=s1, kv=s2))  # noqa
        o = jax.vmap(attend)(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), q_seg, kv_seg)
        return from_zigzag(o.swapaxes(1, 2), axis(seq))

    def attend(interp):
        def call(q, k, v, seg):
            kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=head_shards, q_seq_shards=n,
                                        interpret=interp)
            names = (kernel.manual_sharding_spec(split), BTHD, BSHD, BSHD, ("activation_batch", "activation_length"),
                     ("activation_batch", None))
            return sharding.shard_map_for(run, body, names, BTHD)(kernel, q, k, v, seg, seg)
        return call

    q = (q_BTHK.astype(jnp.float32) * scale).astype(q_BTHK.dtype)
    seg = segment_BT.astype(jnp.int32)
    if interpret is None:
        o = jax.lax.platform_dependent(q, k_BSHK, v_BSHV, seg, tpu=attend(False), default=attend(True))
    else:
        o = attend(interpret)(q, k_BSHK, v_BSHV, seg)
    return o.astype(q_BTHK.dtype)


def matmul_params(spec: MLASpec) -> int:
    """Weights a token is multiplied by: the q path, kv_a, kv_b and dense."""
    E, H = spec.emb_dim, spec.num_query_heads
    Rq, Rkv, Dqk, Dv, Dr = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_head_dim, spec.v_head_dim, spec.qk_rope_head_dim
    q = E * Rq + Rq * H * Dqk if Rq else E * H * Dqk
    gate = E * H if spec.mla_output_gate else 0
    return q + E * (Rkv + Dr) + Rkv * H * (spec.qk_nope_head_dim + Dv) + H * Dv * E + gate


def mixing_flops(spec: MLASpec, seq_len: int) -> float:
    """Forward attention FLOPs per token: causal softmax attention over seq_len tokens, the mean
    context being seq_len/2: 2 H (qk_head_dim + v_head_dim) seq_len/2."""
    return 2 * spec.num_query_heads * (spec.qk_head_dim + spec.v_head_dim) * seq_len / 2


def hf_params(layout: str) -> list[tuple]:
    """(HF tensor suffix in a layer, state sub-path, nin, aliases) of this layer's weights
    (`ling2.convert.mapping.Entry`), in the bailing (`attention.*`) or DeepSeek-V3 (`self_attn.*`) layout."""
    a, out = ("self_attn", "o_proj") if layout == "deepseek_v3" else ("attention", "dense")
    return [(f"{a}.q_a_proj.weight", ("attention", "q_a"), 1, ()),
            (f"{a}.q_a_layernorm.weight", ("attention", "q_a_norm", "weight"), 0, ()),
            (f"{a}.q_b_proj.weight", ("attention", "q_b"), 1, ()),
            (f"{a}.q_proj.weight", ("attention", "q"), 1, ()),
            (f"{a}.kv_a_proj_with_mqa.weight", ("attention", "kv_a"), 1, ()),
            (f"{a}.kv_a_layernorm.weight", ("attention", "kv_a_norm", "weight"), 0, ()),
            (f"{a}.kv_b_proj.weight", ("attention", "kv_b"), 1, ()),
            (f"{a}.{out}.weight", ("attention", "dense"), 2, ()),
            (f"{a}.g_proj.weight", ("attention", "g_proj"), 1, ())]


class MLA(nnx.Module):
    """Multi-head latent attention. Call with x [B,T,E], positions/segment_ids [B,T]."""

    def __init__(self, spec: MLASpec, *, rngs: nnx.Rngs):
        E, H = spec.emb_dim, spec.num_query_heads
        self.H, self.Dn, self.Dr, self.Dv = H, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.Rq, self.Rkv = spec.q_lora_rank, spec.kv_lora_rank
        if self.Dr != spec.rotary_dim:
            raise ValueError(f"qk_rope_head_dim={self.Dr} must equal head_dim*partial_rotary_factor={spec.rotary_dim}")
        wdt = jnp.dtype(spec.weight_dtype)
        init = nnx.initializers.normal(spec.init_std)

        def param(shape, names):
            return nnx.Param(init(rngs.params(), shape, wdt), out_sharding=names, eager_sharding=False)

        Dqk = self.Dn + self.Dr
        if self.Rq:
            self.q_a = param((E, self.Rq), ("embed", "q_lora"))
            self.q_a_norm = norms.RMSNorm(self.Rq, eps=LORA_NORM_EPS, param_dtype=wdt)
            self.q_b = param((self.Rq, H, Dqk), ("q_lora", "heads", "kv"))
        else:
            self.q = param((E, H, Dqk), ("embed", "heads", "kv"))
        self.kv_a = param((E, self.Rkv + self.Dr), ("embed", "kv_lora"))
        self.kv_a_norm = norms.RMSNorm(self.Rkv, eps=LORA_NORM_EPS, param_dtype=wdt)
        self.kv_b = param((self.Rkv, H, self.Dn + self.Dv), ("kv_lora", "heads", "kv"))
        self.dense = param((H, self.Dv, E), ("heads", "kv", "embed"))
        if spec.mla_output_gate:
            self.g_proj = param((E, H), ("embed", "heads"))
        self.output_gate = spec.mla_output_gate
        self.dtype, self.kernel, self.interleaved = spec.dtype, spec.run.attention_kernel, spec.mla_interleaved_rope
        self.fp8 = fp8.of(spec.run)
        self.block = spec.run.attention_block_size
        self.inv_freq = tuple(float(f) for f in yarn.rope_inv_freq(spec))
        self.rope_scaling = yarn.rope_attention_scaling(spec)
        self.scale = yarn.mla_softmax_scale(spec)
        self.run = spec.run

    def _w(self, p):
        return p[...].astype(jnp.dtype(self.dtype))

    def project(self, x_BTE, positions_BT):
        """(q [B,T,H,nope+rope] with its rope part rotated, normed c_kv [B,T,kv_lora], rotated k_rope
        [B,T,rope]): everything attention needs from the new tokens; the latents are what a cache keeps."""
        x = x_BTE.astype(jnp.dtype(self.dtype))
        if self.Rq:
            q_a = self.q_a_norm(fp8.einsum("bte,er->btr", x, self._w(self.q_a), self.fp8))
            q_BTHK = fp8.einsum("btr,rhk->bthk", q_a, self._w(self.q_b), self.fp8)
        else:
            q_BTHK = fp8.einsum("bte,ehk->bthk", x, self._w(self.q), self.fp8)
        q_BTHK = constrain(q_BTHK, ("activation_batch", "activation_length", "activation_heads", None), self.run)
        kv_a = fp8.einsum("bte,er->btr", x, self._w(self.kv_a), self.fp8)
        c_kv = self.kv_a_norm(kv_a[..., :self.Rkv])
        q_rope, k_rope = q_BTHK[..., self.Dn:], kv_a[..., None, self.Rkv:]
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        rot = lambda t: rope.apply_rotary(t, positions_BT, self.Dr, inv_freq=self.inv_freq, scaling=self.rope_scaling)
        q_rope, k_rope = rot(q_rope), rot(k_rope)[:, :, 0]
        return jnp.concatenate([q_BTHK[..., :self.Dn], q_rope], axis=-1), c_kv, k_rope

    def expand(self, c_kv_BSC, k_rope_BSR, length="activation_length"):
        """Per-head K [B,S,H,nope+rope] and V [B,S,H,v] from latents (kv_b up-projection); `length`: the
        logical name their S dim is sharded by (None: whole on every device)."""
        kv = fp8.einsum("bsr,rhk->bshk", c_kv_BSC, self._w(self.kv_b), self.fp8)
        k_nope, v_BSHV = kv[..., :self.Dn], kv[..., self.Dn:]
        k_BSHK = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope_BSR[:, :, None], (*k_nope.shape[:3], self.Dr))],
                                 axis=-1)
        names = ("activation_batch", length, "activation_heads", None)
        return constrain(k_BSHK, names, self.run), constrain(v_BSHV, names, self.run)

    def absorbed(self, q_BTHK, c_kv_BSC, k_rope_BSR, mask_BTS):
        """Attention against latents without expanding them: o [B,T,H,v].

        q_nope is mapped into the latent space by kv_b's key half (q_lat = q_nope W_kb^T, [B,T,H,kv_lora]),
        scores are q_lat.c_kv + q_rope.k_rope, the probabilities average the latents and kv_b's value
        half maps the result up: the same numbers as attending to expand()'s K and V, in kv_lora +
        rope work per cached slot and head instead of an up-projection of every slot."""
        w = self._w(self.kv_b)
        w_k, w_v = w[..., :self.Dn], w[..., self.Dn:]
        f32 = jnp.float32
        q_lat = jnp.einsum("bthn,rhn->bthr", q_BTHK[..., :self.Dn], w_k, preferred_element_type=f32)
        logits = (jnp.einsum("bthr,bsr->bhts", q_lat.astype(c_kv_BSC.dtype), c_kv_BSC, preferred_element_type=f32)
                  + jnp.einsum("bthd,bsd->bhts", q_BTHK[..., self.Dn:], k_rope_BSR, preferred_element_type=f32))
        logits = jnp.where(mask_BTS[:, None], logits * self.scale, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(c_kv_BSC.dtype)
        o_lat = jnp.einsum("bhts,bsr->bthr", probs, c_kv_BSC, preferred_element_type=f32)
        return jnp.einsum("bthr,rhv->bthv", o_lat.astype(w_v.dtype), w_v, preferred_element_type=f32).astype(
            q_BTHK.dtype)

    def _attend(self, q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, mask_BTS=None):
        """The configured backend (`ling2.kernels.attention`); `mask_BTS` None: causal + same segment."""
        return attention_ops.attention(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, self.scale, backend=self.kernel,
                                       block=self.block, mask_BTS=mask_BTS)

    def _out(self, x_BTE, o_BTHV):
        """The output gate (Ling 3) and the dense projection: [B,T,E]."""
        o_BTHV = constrain(o_BTHV, ("activation_batch", "activation_length", "activation_heads", None), self.run)
        if self.output_gate:
            x = x_BTE.astype(jnp.dtype(self.dtype))
            gate = jax.nn.sigmoid(jnp.einsum("bte,eh->bth", x, self._w(self.g_proj)).astype(jnp.float32))
            o_BTHV = (o_BTHV.astype(jnp.float32) * gate[..., None]).astype(o_BTHV.dtype)
        out = fp8.einsum("bthv,hve->bte", o_BTHV, self._w(self.dense), self.fp8)
        return constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.run)

    def __call__(self, x_BTE, positions_BT, segment_ids_BT=None, *, layer_index=None):
        """Training forward: out [B,T,E], causal within each segment. `layer_index`: unused (MLA layers
        differ only in their weights)."""
        B, T, _ = x_BTE.shape
        q_BTHK, c_kv, k_rope = self.project(x_BTE, positions_BT)
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        cp = sharding.context_axes(self.run, T, "mla")
        if cp is not None:
            return self._out(x_BTE, self._attend_context(q_BTHK, c_kv, k_rope, segment_ids_BT, cp))
        k_BSHK, v_BSHV = self.expand(c_kv, k_rope)
        return self._out(x_BTE, self._attend(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT))

    def _attend_context(self, q_BTHK, c_kv_BTC, k_rope_BTR, segment_ids_BT, cp):
        """Attention with the sequence split over the context axis (or axes) `cp`: the latents (c_kv + k_rope,
        kv_lora + rope values per token) are all-gathered along it and expanded on every device; each device
        attends its own queries to the keys before them (`splash_context_attention` for attention_kernel=flash, else
        `balanced_context_attention`: the queries in the zigzag layout, so every device does the same causal
        work; cuDNN's fused kernel takes equal q and kv lengths only)."""
        whole = ("activation_batch", None, None)
        c_kv_BTC, k_rope_BTR = constrain(c_kv_BTC, whole, self.run), constrain(k_rope_BTR, whole, self.run)
        k_BSHK, v_BSHV = self.expand(c_kv_BTC, k_rope_BTR, length=None)
        split, BTHD = ("activation_batch", "activation_length"), ("activation_batch", "activation_length",
                                                                  "activation_heads", None)
        BSHD = ("activation_batch", None, "activation_heads", None)

        if self.kernel == "flash":
            return splash_context_attention(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, self.scale, self.run)

        def body(q, k, v, seg, kv_seg):
            return balanced_context_attention(q, k, v, seg, kv_seg, self.scale, axis_name=cp, block=self.block)

        f = sharding.shard_map_for(self.run, body, (BTHD, BSHD, BSHD, split, ("activation_batch", None)), BTHD)
        return f(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, segment_ids_BT)

    # ---- cached decoding (ling2.layers.attention.decode) ----

    def init_cache(self, batch: int, max_len: int) -> "MLACache":
        """Empty latent cache of max_len slots per row."""
        dt = jnp.dtype(self.dtype)
        return MLACache(jnp.zeros((batch, max_len, self.Rkv), dt), jnp.zeros((batch, max_len, self.Dr), dt))

    def _write(self, cache, c_kv, k_rope, state):
        return MLACache(write_rows(cache.c_kv_BSC, c_kv, state.index_B),
                        write_rows(cache.k_rope_BSR, k_rope, state.index_B))

    def prefill(self, x_BTE, positions_BT, segment_ids_BT, cache, state, opts, *, layer_index=None):
        """Rows with empty caches: the configured kernel among the new tokens; their latents are stored."""
        T = x_BTE.shape[1]
        q_BTHK, c_kv, k_rope = self.project(x_BTE, positions_BT)
        cache = self._write(cache, c_kv, k_rope, state)
        k_BSHK, v_BSHV = self.expand(c_kv, k_rope)
        out = self._out(x_BTE, self._attend(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT))
        return overflow_to_nan(out, state, T, cache.c_kv_BSC.shape[1]), cache

    def step(self, x_BTE, positions_BT, segment_ids_BT, cache, state, opts, *, layer_index=None):
        """New tokens against every visible slot (theirs included), absorbed (opts.absorb) or expanded."""
        T = x_BTE.shape[1]
        q_BTHK, c_kv, k_rope = self.project(x_BTE, positions_BT)
        cache = self._write(cache, c_kv, k_rope, state)
        mask = decode_mask(state, segment_ids_BT)
        c_all, r_all = cache.c_kv_BSC.astype(q_BTHK.dtype), cache.k_rope_BSR.astype(q_BTHK.dtype)
        if opts.absorb:
            o_BTHV = self.absorbed(q_BTHK, c_all, r_all, mask)
        else:
            k_BSHK, v_BSHV = self.expand(c_all, r_all)
            o_BTHV = self._attend(q_BTHK, k_BSHK, v_BSHV, segment_ids_BT, mask)
        return overflow_to_nan(self._out(x_BTE, o_BTHV), state, T, cache.c_kv_BSC.shape[1]), cache

    def accept(self, old, new, keep_B, live_B):
        """Slots past a row's kept tokens are stale and never read (the decoder moves its index back)."""
        return new

    def unpack(self, packed, empty, gather):
        """Each padded slot's latents from its packed slot."""
        T = gather.row.shape[1]
        L = packed.c_kv_BSC.shape[1]
        put = lambda e, x: e.at[:, :T].set(move_slots(x[:, :L], gather))  # noqa: E731
        return MLACache(put(empty.c_kv_BSC, packed.c_kv_BSC), put(empty.k_rope_BSR, packed.k_rope_BSR))


@struct.dataclass
class MLACache:
    """Latent KV cache: normed c_kv [B,S,kv_lora] and rotated k_rope [B,S,rope] per slot (the slot
    bookkeeping is `ling2.layers.attention.decode`'s)."""

    c_kv_BSC: jax.Array
    k_rope_BSR: jax.Array
