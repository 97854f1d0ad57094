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
(one document per row). Under a mesh the kernel runs inside `shard_map` like the GLA layer's.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ling2.kernels import kda
from ling2.layers import norms, sharding

L2_EPS = 1e-6  # the reference's q/k L2-norm eps, whatever rms_norm_eps is


def matmul_params(cfg) -> int:
    """Weights a token is multiplied by: q, k, v, f, g projections, b_proj and dense."""
    E, H, D = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim
    return 6 * E * H * D + E * H


def mixing_flops(cfg, seq_len: int) -> float:
    """Forward token-mixing FLOPs per token (chunked, chunk C), per head: the state read, decay and
    delta update (6 D^2), the intra-chunk q.k / k.k scores and their products with v (4 D C), the
    short conv (6 D K)."""
    H, D, C, K = cfg.num_query_heads, cfg.head_dim, min(cfg.kda_chunk_size, seq_len), cfg.kda_conv_kernel_size
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


class KimiDeltaAttention(nnx.Module):
    """Ling 3 linear-attention layer. Call with x [B,T,E], positions [B,T] (unused: no RoPE), optional
    segment_ids [B,T]."""

    def __init__(self, cfg, layer_idx: int, *, rngs: nnx.Rngs):
        E, H, D, K = cfg.emb_dim, cfg.num_query_heads, cfg.head_dim, cfg.kda_conv_kernel_size
        self.H, self.D, self.K, self.layer_idx = H, D, K, layer_idx
        wdt = jnp.dtype(cfg.weight_dtype)
        normal = nnx.initializers.normal(cfg.init_std)

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
        self.o_norm = norms.RMSNorm(D, eps=cfg.normalization_layer_epsilon, param_dtype=wdt)
        self.dense = param((H, D, E), ("heads", "kv", "embed"))
        self.safe_gate, self.lower_bound = cfg.kda_safe_gate, float(cfg.kda_lower_bound)
        self.dtype, self.chunk_size, self.backend = cfg.dtype, cfg.kda_chunk_size, cfg.kda_backend
        self.rules = sharding.rules_dict(cfg.logical_axis_rules)

    def init_cache(self, batch: int):
        """Decode cache: the last K-1 pre-conv [q | k | v] rows [B, K-1, 3, H, D] and the fp32 recurrent
        state [B, H, D, D] (one document per row)."""
        return {"conv": jnp.zeros((batch, self.K - 1, 3, self.H, self.D), jnp.dtype(self.dtype)),
                "state": jnp.zeros((batch, self.H, self.D, self.D), jnp.float32)}

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
        """kda (h0 None: zero state); under a mesh inside shard_map with batch and heads split."""
        def run(q, k, v, g, beta, seg, *h0):
            return kda.kda(q, k, v, g, beta, segment_ids=seg, initial_state=h0[0] if h0 else None,
                           chunk_size=self.chunk_size, backend=self.backend, return_final_state=True)

        state = () if h0 is None else (h0,)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            return run(q, k, v, g, beta, seg, *state)
        spec = sharding.logical_to_spec(("activation_batch", None, "activation_heads", None), q.shape, self.rules, mesh)
        bt, ht = spec[0], spec[2]
        state_spec = P(bt, ht, None, None)
        specs = (spec, spec, spec, spec, P(bt, None, ht), P(bt, None)) + (state_spec,) * len(state)
        # check_vma=False: Pallas kernels inside do not annotate how their outputs vary over the mesh.
        return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=(spec, state_spec), check_vma=False)(
            q, k, v, g, beta, seg, *state)

    def _conv_weight(self):
        """[K, 3, H, D]: the q, k, v conv taps side by side."""
        w = jnp.stack([self.q_conv[...], self.k_conv[...], self.v_conv[...]], axis=0)  # [3, H, D, K]
        return jnp.moveaxis(w, -1, 0)

    def __call__(self, x_BTE, positions_BT=None, segment_ids_BT=None, cache=None, decode=None):
        """Returns out [B,T,E] (and the updated cache when one is given).

        With a cache, `decode` (a `ling2.layers.decode.DecodeState`; None: prefill unless T == 1)
        picks the chunked kernel from the cached state (prefill: segment ids reset the conv window and
        the state, so left padding never reaches a row's document) or one recurrence step per token
        (decode; `token_states` also returns the state and conv window after every token)."""
        B, T, _ = x_BTE.shape
        H, D, K = self.H, self.D, self.K
        x = x_BTE.astype(jnp.dtype(self.dtype))
        qkv = jnp.stack([jnp.einsum("bte,ehd->bthd", x, self._w(p)) for p in (self.q_proj, self.k_proj, self.v_proj)],
                        axis=2)  # [B, T, 3, H, D]
        w = self._conv_weight().reshape(K, 3 * H * D)
        flat = qkv.reshape(B, T, 3 * H * D)
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        stepwise = cache is not None and (T == 1 if decode is None else not decode.fresh)
        if decode is not None and decode.packed_docs:
            raise ValueError("kda: packed prefill (packed_docs) is not supported; prefill one document per row")
        if stepwise:  # continue the row's one document from its cached conv window
            hist = cache["conv"].reshape(B, K - 1, 3 * H * D)
            y = causal_conv(flat, w, history_BPC=hist)
            rows = jnp.concatenate([hist.astype(flat.dtype), flat], axis=1)  # [B, K-1+T, C]
        else:
            y = causal_conv(flat, w, segment_ids_BT)
            if cache is not None:  # the last K-1 rows of the last document (zeros before its start)
                rows = jnp.pad(flat, ((0, 0), (K - 1, 0), (0, 0)))[:, -(K - 1):]
                seg = jnp.pad(segment_ids_BT, ((0, 0), (K - 1, 0)), constant_values=-1)[:, -(K - 1):]
                rows = jnp.where((seg == segment_ids_BT[:, -1:])[..., None], rows, 0)
        y = jax.nn.silu(y).reshape(B, T, 3, H, D)
        q, k, v = l2_normalize(y[:, :, 0]), l2_normalize(y[:, :, 1]), y[:, :, 2]
        names = ("activation_batch", "activation_length", "activation_heads", None)
        q, k, v = (sharding.constrain(a, names) for a in (q, k, v))
        g = self.gate(x)
        beta = jax.nn.sigmoid(jnp.einsum("bte,eh->bth", x, self._w(self.b_proj)).astype(jnp.float32))
        h0 = None if cache is None else cache["state"]
        new = {}
        if stepwise:
            o, states = [], []
            hT = h0
            for t in range(T):
                o_t, hT = kda.kda_step(hT, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
                o.append(o_t)
                states.append(hT)
            o = jnp.stack(o, axis=1)
            if decode is not None and decode.token_states:
                new["states"] = jnp.stack(states, axis=1)
                conv_dt = cache["conv"].dtype
                new["convs"] = jnp.stack([rows[:, t + 1:t + K].reshape(B, K - 1, 3, H, D).astype(conv_dt)
                                          for t in range(T)], axis=1)
            rows = rows[:, -(K - 1):]
        else:
            o, hT = self._kernel(q, k, v, g, beta, segment_ids_BT, h0)
        o = sharding.constrain(o, names)
        gate = jax.nn.sigmoid(jnp.einsum("bte,ehd->bthd", x, self._w(self.g_proj)).astype(jnp.float32))
        o = (self.o_norm(o.astype(jnp.float32)) * gate).astype(x.dtype)
        out = jnp.einsum("bthd,hde->bte", o, self._w(self.dense))
        out = sharding.constrain(out, ("activation_batch", "activation_length", "activation_embed"))
        if cache is None:
            return out
        conv = rows.reshape(B, K - 1, 3, H, D).astype(cache["conv"].dtype)
        return out, {"conv": conv, "state": hT, **new}
