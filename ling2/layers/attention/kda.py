"""Kimi Delta Attention layer of Ling 3 (HF bailing_hybrid linear attention), Flax NNX.

  q, k, v = x W_q, x W_k, x W_v                                      [B,T,H,D] each
  [q | k | v] = SiLU(causal depthwise conv_K([q | k | v]))            no bias; zeros before a document start
  q, k = q / sqrt(sum_D q^2 + 1e-6), same for k                       (eps inside the sqrt)
  f = x W_f + dt_bias;  a = exp(A_log) [H]
  g = lower_bound * sigmoid(a f)   (kda_safe_gate)   or   -a softplus(f)         [B,T,H,D] fp32
  beta = sigmoid(x W_b)                                               [B,T,H]
  o = kda(q, k, v, g, beta)        delta rule, state reset at each new segment id
  out = (RMSNorm_D(o) * sigmoid(x W_g)) W_dense                       [B,T,E]

x is the normed block input; the gate, beta and the output gate read x, not the conv output.
There is no RoPE. Decoding keeps the last K-1 pre-conv [q | k | v] rows and the fp32 state
(one document per row). Under a mesh the kernel runs inside `shard_map` like the GLA layer's,
through `kda_cp` when the sequence is split over a context axis; the conv reads across shard
edges as any op on the split sequence does (XLA moves the previous shard's last K-1 rows).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ling2.config.specs import KDASpec
from ling2.kernels import kda
from ling2.layers import norms, sharding
from ling2.kernels import fp8
from ling2.layers.attention.decode import take_rows, where_rows

L2_EPS = 1e-6  # the reference's q/k L2-norm eps, whatever rms_norm_eps is


def matmul_params(spec: KDASpec) -> int:
    """Weights a token is multiplied by: q, k, v, f, g projections, b_proj and dense."""
    E, H, D = spec.emb_dim, spec.num_query_heads, spec.head_dim
    return 6 * E * H * D + E * H


def mixing_flops(spec: KDASpec, seq_len: int) -> float:
    """Forward token-mixing FLOPs per token (chunked, chunk C), per head: the state read, decay and
    delta update (6 D^2), the intra-chunk q.k / k.k scores and their products with v (4 D C), the
    short conv (6 D K)."""
    H, D, K = spec.num_query_heads, spec.head_dim, spec.kda_conv_kernel_size
    C = min(spec.run.kda_chunk_size, seq_len)
    return H * (6 * D * D + 4 * D * C + 6 * D * K)


def l2_normalize(x):
    """x / sqrt(sum x^2 + 1e-6) over the last dim, in fp32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)


def causal_conv(x_BTC, w_KC, segment_ids_BT=None, history_BPC=None):
    """Depthwise causal conv: y[t] = sum_j w[j] x[t-(K-1)+j], zeros before the start.

    With `segment_ids_BT`, taps reaching into an earlier document read zero (each document starts
    afresh). `history_BPC` ([B, K-1, C], decode) are the rows before x, from the same document."""
    K = w_KC.shape[0]
    T = x_BTC.shape[1]
    if history_BPC is not None:
        x_BTC = jnp.concatenate([history_BPC.astype(x_BTC.dtype), x_BTC], axis=1)
        pad = 0
    else:
        pad = K - 1
    xp = jnp.pad(x_BTC, ((0, 0), (pad, 0), (0, 0)))
    if segment_ids_BT is not None and history_BPC is None:
        seg = jnp.pad(segment_ids_BT, ((0, 0), (pad, 0)), constant_values=-1)
    y = jnp.zeros(x_BTC.shape[:1] + (T, x_BTC.shape[2]), jnp.float32)
    start = xp.shape[1] - T  # index in xp of the first output token
    for j in range(K):
        s = K - 1 - j  # how far back tap j reads
        tap = xp[:, start - s:start - s + T].astype(jnp.float32)
        if segment_ids_BT is not None and history_BPC is None:
            tap = jnp.where((seg[:, start - s:start - s + T] == segment_ids_BT)[..., None], tap, 0.0)
        y = y + tap * w_KC[j].astype(jnp.float32)
    return y.astype(x_BTC.dtype)


def a_log_init(key, shape, dtype):
    """A = exp(A_log) uniform in [1, 16] (the reference's init)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def dt_bias_init(key, shape, dtype):
    """dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (the reference's init)."""
    u = jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1))
    dt = jnp.maximum(jnp.exp(u), 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def hf_params(layout: str) -> list[tuple]:
    """(HF tensor suffix in a layer, state sub-path, nin, aliases[, reshape]) of this layer's weights
    (`ling2.convert.mapping.Entry`); bailing_hybrid's on-disk names (transformers renames them only in memory)."""
    a = "attention"
    out = [(f"{a}.{p}.weight", ("attention", p), 1, ()) for p in ("q_proj", "k_proj", "v_proj")]
    out += [(f"{a}.{p}_conv1d.weight", ("attention", f"{p}_conv"), 0, (), "conv") for p in "qkv"]
    return out + [(f"{a}.f_proj.weight", ("attention", "f_proj"), 1, ()),
                  (f"{a}.dt_bias", ("attention", "dt_bias"), 0, (), "flat"),
                  (f"{a}.A_log", ("attention", "A_log"), 0, ()),
                  (f"{a}.b_proj.weight", ("attention", "b_proj"), 1, ()),
                  (f"{a}.g_proj.weight", ("attention", "g_proj"), 1, ()),
                  (f"{a}.o_norm.weight", ("attention", "o_norm", "weight"), 0, ()),
                  (f"{a}.dense.weight", ("attention", "dense"), 2, ())]


class KimiDeltaAttention(nnx.Module):
    """Ling 3 linear-attention layer. Call with x [B,T,E], positions [B,T] (unused: no RoPE), optional
    segment_ids [B,T]."""

    def __init__(self, spec: KDASpec, *, rngs: nnx.Rngs):
        E, H, D, K = spec.emb_dim, spec.num_query_heads, spec.head_dim, spec.kda_conv_kernel_size
        self.H, self.D, self.K = H, D, K
        wdt = jnp.dtype(spec.weight_dtype)
        normal = nnx.initializers.normal(spec.init_std)

        def param(shape, names, init=normal):
            return nnx.Param(init(rngs.params(), shape, wdt), out_sharding=names, eager_sharding=False)

        bound = 1.0 / math.sqrt(K)  # torch Conv1d's default init for a depthwise conv (fan_in K)
        conv_init = lambda key, shape, dt: jax.random.uniform(key, shape, dt, -bound, bound)  # noqa: E731
        self.q_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.k_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.v_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.q_conv = param((H, D, K), ("heads", "kv", None), conv_init)
        self.k_conv = param((H, D, K), ("heads", "kv", None), conv_init)
        self.v_conv = param((H, D, K), ("heads", "kv", None), conv_init)
        self.f_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.dt_bias = param((H, D), ("heads", "kv"), dt_bias_init)
        self.A_log = param((H,), ("heads",), a_log_init)
        self.b_proj = param((E, H), ("embed", "heads"))
        self.g_proj = param((E, H, D), ("embed", "heads", "kv"))
        self.o_norm = norms.RMSNorm(D, eps=spec.normalization_layer_epsilon, param_dtype=wdt)
        self.dense = param((H, D, E), ("heads", "kv", "embed"))
        self.safe_gate, self.lower_bound = spec.kda_safe_gate, float(spec.kda_lower_bound)
        self.dtype, self.chunk_size, self.backend = spec.dtype, spec.run.kda_chunk_size, spec.run.kda_backend
        self.fp8 = fp8.of(spec.run)
        self.run = spec.run

    def _w(self, p):
        return p[...].astype(jnp.dtype(self.dtype))

    def gate(self, x_BTE):
        """Per-key-dim log forget gate g [B,T,H,D] fp32 (safe: in (lower_bound, 0))."""
        f = jnp.einsum("bte,ehd->bthd", x_BTE, self._w(self.f_proj)).astype(jnp.float32)
        f = f + self.dt_bias[...].astype(jnp.float32)
        a = jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
        if self.safe_gate:
            return self.lower_bound * jax.nn.sigmoid(a * f)
        return -a * jax.nn.softplus(f)

    def _kernel(self, q, k, v, g, beta, seg, h0):
        """kda (h0 None: zero state); under a mesh inside shard_map with batch and heads split. With the
        sequence split over a context axis, each device runs its shard by `kda_cp` (training only)."""
        BHKV = ("activation_batch", "activation_heads", None, None)
        cp = sharding.context_axes(self.run, q.shape[1], "kda")
        if cp is not None:
            if h0 is not None:
                raise ValueError("kda: context parallelism splits training sequences; cached decoding (an initial "
                                 "state) runs with the context axis of size 1")

            def run_cp(q, k, v, g, beta, seg):
                return kda.kda_cp(q, k, v, g, beta, axis_name=cp, segment_ids=seg, chunk_size=self.chunk_size,
                                  backend=self.backend)

            BTHD = ("activation_batch", "activation_length", "activation_heads", None)
            names = (BTHD, BTHD, BTHD, BTHD, BTHD[:3], BTHD[:2])
            return sharding.shard_map_for(self.run, run_cp, names, BTHD)(q, k, v, g, beta, seg), None

        def run(q, k, v, g, beta, seg, *h0):
            return kda.kda(q, k, v, g, beta, segment_ids=seg, initial_state=h0[0] if h0 else None,
                           chunk_size=self.chunk_size, backend=self.backend, return_final_state=True)

        state = () if h0 is None else (h0,)
        BTHD = ("activation_batch", None, "activation_heads", None)
        names = (BTHD, BTHD, BTHD, BTHD, ("activation_batch", None, "activation_heads"), ("activation_batch", None))
        return sharding.shard_map_for(self.run, run, names + (BHKV,) * len(state), (BTHD, BHKV))(
            q, k, v, g, beta, seg, *state)

    def _conv_weight(self):
        """[K, 3, H, D]: the q, k, v conv taps side by side."""
        w = jnp.stack([self.q_conv[...], self.k_conv[...], self.v_conv[...]], axis=0)  # [3, H, D, K]
        return jnp.moveaxis(w, -1, 0)

    def _project(self, x_BTE):
        """(x in the compute dtype, the pre-conv [q | k | v] rows [B,T,3HD], the conv taps [K, 3HD])."""
        B, T, _ = x_BTE.shape
        x = x_BTE.astype(jnp.dtype(self.dtype))
        qkv = jnp.stack([fp8.einsum("bte,ehd->bthd", x, self._w(p), self.fp8) for p in (self.q_proj, self.k_proj, self.v_proj)],
                        axis=2)  # [B, T, 3, H, D]
        return x, qkv.reshape(B, T, 3 * self.H * self.D), self._conv_weight().reshape(self.K, -1)

    def _mix_inputs(self, x, y_BTC):
        """q, k (L2-normed), v [B,T,H,D] from the conv output, the gate g [B,T,H,D] and beta [B,T,H]."""
        B, T, _ = y_BTC.shape
        y = jax.nn.silu(y_BTC).reshape(B, T, 3, self.H, self.D)
        q, k, v = l2_normalize(y[:, :, 0]), l2_normalize(y[:, :, 1]), y[:, :, 2]
        names = ("activation_batch", "activation_length", "activation_heads", None)
        q, k, v = (sharding.constrain(a, names, self.run) for a in (q, k, v))
        beta = jax.nn.sigmoid(jnp.einsum("bte,eh->bth", x, self._w(self.b_proj)).astype(jnp.float32))
        return q, k, v, self.gate(x), beta

    def _out(self, x, o_BTHD):
        """Output norm, gate and dense projection: [B,T,E]."""
        o = sharding.constrain(o_BTHD, ("activation_batch", "activation_length", "activation_heads", None), self.run)
        gate = jax.nn.sigmoid(fp8.einsum("bte,ehd->bthd", x, self._w(self.g_proj), self.fp8).astype(jnp.float32))
        o = (self.o_norm(o.astype(jnp.float32)) * gate).astype(x.dtype)
        out = fp8.einsum("bthd,hde->bte", o, self._w(self.dense), self.fp8)
        return sharding.constrain(out, ("activation_batch", "activation_length", "activation_embed"), self.run)

    def __call__(self, x_BTE, positions_BT=None, segment_ids_BT=None, *, layer_index=None):
        """Training forward: out [B,T,E], the conv window and the state restarting at every segment.
        `layer_index`: unused (KDA layers differ only in their weights)."""
        B, T, _ = x_BTE.shape
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        x, flat, w = self._project(x_BTE)
        q, k, v, g, beta = self._mix_inputs(x, causal_conv(flat, w, segment_ids_BT))
        o, _ = self._kernel(q, k, v, g, beta, segment_ids_BT, None)
        return self._out(x, o)

    # ---- cached decoding (ling2.layers.attention.decode) ----

    def init_cache(self, batch: int, max_len: int) -> "KDACache":
        """The last K-1 pre-conv rows and the fp32 state, zero (one document per row; max_len is not needed)."""
        return KDACache(jnp.zeros((batch, self.K - 1, 3, self.H, self.D), jnp.dtype(self.dtype)),
                        jnp.zeros((batch, self.H, self.D, self.D), jnp.float32))

    def prefill(self, x_BTE, positions_BT, segment_ids_BT, cache, state, opts, *, layer_index=None):
        """The chunked kernel from the cached state; segment ids reset the conv window and the state, so left
        padding never reaches a row's document. Keeps the last K-1 rows of each row's last document."""
        if opts.packed_docs:
            raise ValueError("kda: packed prefill (packed_docs) is not supported; prefill one document per row")
        B, K = x_BTE.shape[0], self.K
        x, flat, w = self._project(x_BTE)
        q, k, v, g, beta = self._mix_inputs(x, causal_conv(flat, w, segment_ids_BT))
        o, hT = self._kernel(q, k, v, g, beta, segment_ids_BT, cache.state_BHKV)
        rows = jnp.pad(flat, ((0, 0), (K - 1, 0), (0, 0)))[:, -(K - 1):]  # zeros before its start
        seg = jnp.pad(segment_ids_BT, ((0, 0), (K - 1, 0)), constant_values=-1)[:, -(K - 1):]
        rows = jnp.where((seg == segment_ids_BT[:, -1:])[..., None], rows, 0)
        conv = rows.reshape(B, K - 1, 3, self.H, self.D).astype(cache.conv_BPCHD.dtype)
        return self._out(x, o), KDACache(conv, hT)

    def step(self, x_BTE, positions_BT, segment_ids_BT, cache, state, opts, *, layer_index=None):
        """One recurrence step per new token, continuing the row's document from its cached conv window;
        with opts.history also the conv window and state after each."""
        B, T, _ = x_BTE.shape
        H, D, K = self.H, self.D, self.K
        x, flat, w = self._project(x_BTE)
        hist = cache.conv_BPCHD.reshape(B, K - 1, 3 * H * D)
        q, k, v, g, beta = self._mix_inputs(x, causal_conv(flat, w, history_BPC=hist))
        rows = jnp.concatenate([hist.astype(flat.dtype), flat], axis=1)  # [B, K-1+T, C]
        o, states, hT = [], [], cache.state_BHKV
        for t in range(T):
            o_t, hT = kda.kda_step(hT, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            o.append(o_t)
            states.append(hT)
        conv_dt = cache.conv_BPCHD.dtype
        window = lambda r: r.reshape(B, K - 1, 3, H, D).astype(conv_dt)  # noqa: E731
        new = KDACache(window(rows[:, -(K - 1):]), hT)
        if opts.history:
            new = new.replace(history_conv_BTPCHD=jnp.stack([window(rows[:, t + 1:t + K]) for t in range(T)], axis=1),
                              history_state_BTHKV=jnp.stack(states, axis=1))
        return self._out(x, jnp.stack(o, axis=1)), new

    def accept(self, old, new, keep_B, live_B):
        """Each live row's conv window and state after its new token keep_B; other rows keep the old ones."""
        return KDACache(where_rows(live_B, take_rows(new.history_conv_BTPCHD, keep_B), old.conv_BPCHD),
                        where_rows(live_B, take_rows(new.history_state_BTHKV, keep_B), old.state_BHKV))

    def unpack(self, packed, empty, gather):
        raise ValueError("kda: packed prefill is not supported; prefill one document per row")


@struct.dataclass
class KDACache:
    """The last K-1 pre-conv [q | k | v] rows [B, K-1, 3, H, D] (the short conv's window) and the fp32 state
    [B, H, D, D]; after a step with opts.history both after every new token ([B, T, ...])."""

    conv_BPCHD: jax.Array
    state_BHKV: jax.Array
    history_conv_BTPCHD: jax.Array | None = None
    history_state_BTHKV: jax.Array | None = None
