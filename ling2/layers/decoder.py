"""The Ling2 decoder (DecoderBlockType.LING2): embed -> layers -> final RMSNorm -> untied lm_head.

Each layer is pre-norm: x += attn(norm(x)); x += mlp(norm(x)), with attn GLA or MLA by
cfg.layer_types and mlp dense SwiGLU or MoE by cfg.mlp_types.

With `scan_layers`, the layers split into an unscanned prefix (every leading group of
`inhomogeneous_layer_cycle_interval` layers that holds a dense layer, so the pattern
breaks there), scanned groups (k-1 GLA + 1 MLA, all MoE; params stacked on a leading
"layers" axis) and an unscanned suffix (a trailing partial group, all MLA). GLA slopes
depend on the global layer index, so each scanned group gets its own slopes as a scan
input. Layers are built in index order in both modes, so one seed gives the same
weights scanned or not. `remat_policy`: none, full (recompute all), save_dot (keep the
outputs of weight matmuls, recompute the rest).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config import DecoderBlockType
from ling2.layers import norms
from ling2.layers.attention_gla import GatedLinearAttention, layer_slopes
from ling2.layers.attention_mla import MLA
from ling2.layers.embed import Embed, LMHead
from ling2.layers.moe import MoE, Mlp
from ling2.layers.sharding import constrain

ACT = ("activation_batch", "activation_length", "activation_embed")


class DecoderOutput(NamedTuple):
    logits: jax.Array  # [B, T, V], fp32 when cfg.float32_logits
    hidden_pre_norm: jax.Array  # [B, T, E], last layer output
    hidden: jax.Array  # [B, T, E], after the final norm (what MTP consumes)
    moe_aux: dict  # {layer index: MoEAux} for every MoE layer


class DecoderLayer(nnx.Module):
    """One pre-norm block; `attn_type` in {gla, mla}, `mlp_type` in {dense, moe}."""

    def __init__(self, cfg, layer_idx: int, attn_type: str, mlp_type: str, *, rngs: nnx.Rngs):
        eps, wdt = cfg.normalization_layer_epsilon, jnp.dtype(cfg.weight_dtype)
        self.attn_type, self.mlp_type = attn_type, mlp_type
        self.input_norm = norms.RMSNorm(cfg.emb_dim, eps=eps, param_dtype=wdt)
        if attn_type == "mla":
            self.attention = MLA(cfg, rngs=rngs)
        elif attn_type == "gla":
            self.attention = GatedLinearAttention(cfg, layer_idx, rngs=rngs)
        else:
            raise ValueError(f"layer {layer_idx}: unknown attention type {attn_type!r}")
        self.post_attention_norm = norms.RMSNorm(cfg.emb_dim, eps=eps, param_dtype=wdt)
        if mlp_type == "dense":
            self.mlp = Mlp(cfg, cfg.mlp_dim, rngs=rngs)
        elif mlp_type == "moe":
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            raise ValueError(f"layer {layer_idx}: unknown mlp type {mlp_type!r}")

    def init_cache(self, batch: int, max_len: int):
        if self.attn_type == "mla":
            return self.attention.init_cache(batch, max_len)
        return self.attention.init_cache(batch)

    def __call__(self, x_BTE, positions_BT, segment_ids_BT, valid_BT=None, cache=None, log_decay=None):
        """Returns (x [B,T,E], MoEAux or None), plus the new attention cache when `cache` is given.

        `log_decay`: a GLA layer's [H] log-decays when they are traced values (scanned groups)."""
        extra = {} if log_decay is None else {"log_decay": log_decay}
        a = self.attention(self.input_norm(x_BTE), positions_BT, segment_ids_BT, cache=cache, **extra)
        a, cache = a if cache is not None else (a, None)
        h = constrain(x_BTE + a.astype(x_BTE.dtype), ACT)
        aux = None
        if self.mlp_type == "moe":
            y, aux = self.mlp(self.post_attention_norm(h), valid_BT)
        else:
            y = self.mlp(self.post_attention_norm(h))
        out = constrain(h + y.astype(h.dtype), ACT)
        return (out, aux) if cache is None else (out, aux, cache)


class LayerGroup(nnx.Module):
    """Consecutive layers applied in order (one scan step)."""

    def __init__(self, layers):
        self.layers = nnx.List(layers)

    def __call__(self, x_BTE, positions_BT, segment_ids_BT, valid_BT=None, log_decays=None):
        """`log_decays`: optional per-GLA-layer [H] decays overriding the built-in constants."""
        auxes = []
        for j, layer in enumerate(self.layers):
            decay = log_decays[j] if log_decays is not None and layer.attn_type == "gla" else None
            x_BTE, aux = layer(x_BTE, positions_BT, segment_ids_BT, valid_BT, log_decay=decay)
            auxes.append(aux)
        return x_BTE, auxes


def scan_plan(cfg) -> tuple[int, int, int]:
    """(prefix_end, num_groups, group_size): layers [0, prefix_end) unscanned, then num_groups
    scanned groups of group_size, then the rest unscanned."""
    L, k = cfg.num_decoder_layers, cfg.inhomogeneous_layer_cycle_interval
    prefix_end = -(-cfg.first_num_dense_layers // k) * k
    full_end = (L // k) * k
    return min(prefix_end, full_end), max(full_end - prefix_end, 0) // k, k


def remat(fn, policy: str):
    """Wraps fn in jax.checkpoint by cfg.remat_policy."""
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if policy == "save_dot":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"remat_policy: unknown {policy!r} (none, full, save_dot)")


def _stack(groups):
    """One LayerGroup whose Variables hold every group's values on a leading 'layers' axis."""
    gdef, *_ = nnx.split(groups[0])
    states = [nnx.split(g)[1] for g in groups]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    for _, v in nnx.to_flat_state(stacked):
        names = v.get_metadata().get("out_sharding")
        if names:
            v.set_metadata(out_sharding=("layers", *names))
    return nnx.merge(gdef, stacked)


class Ling2Decoder(nnx.Module):
    """Ling2 decoder. Call with ids [B,T], optional positions / segment_ids / valid [B,T]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        if cfg.enable_dropout and cfg.dropout_rate > 0:
            raise ValueError("enable_dropout: dropout is not implemented for the Ling2 decoder (the reference has none)")
        L = cfg.num_decoder_layers
        self.remat_policy, self.scan = cfg.remat_policy, cfg.scan_layers
        self.embed = Embed(cfg, rngs=rngs)
        layers = [DecoderLayer(cfg, i, cfg.layer_types[i], cfg.mlp_types[i], rngs=rngs) for i in range(L)]
        if self.scan:
            p, n, k = scan_plan(cfg)
            self.prefix = nnx.List(layers[:p])
            self.suffix = nnx.List(layers[p + n * k:])
            self.num_groups, self.group_size = n, k
            groups = [LayerGroup(layers[p + g * k:p + (g + 1) * k]) for g in range(n)]
            self.groups = _stack(groups) if n else None
            # Per-group, per-position GLA log-decays [n, k, H] (rows of MLA positions unused).
            decays = np.zeros((max(n, 1), k, cfg.num_query_heads), np.float32)
            for g in range(n):
                for j in range(k):
                    i = p + g * k + j
                    if cfg.layer_types[i] == "gla":
                        decays[g, j] = -layer_slopes(cfg.num_query_heads, i, L, cfg.gla_slope_layer_offset)
            self.group_decays = tuple(map(tuple, decays.reshape(max(n, 1), -1).tolist()))
        else:
            self.layers = nnx.List(layers)
        self.final_norm = norms.RMSNorm(cfg.emb_dim, eps=cfg.normalization_layer_epsilon,
                                        param_dtype=jnp.dtype(cfg.weight_dtype))
        self.tied = cfg.logits_via_embedding
        self.logits_dtype = "float32" if cfg.float32_logits else cfg.dtype
        self.lm_head = None if self.tied else LMHead(cfg, rngs=rngs)
        self.num_heads = cfg.num_query_heads

    def _run(self, module, x, positions, segment_ids, valid, decays=None):
        """Applies a layer or group functionally, under the remat policy."""
        gdef, state = nnx.split(module)

        def f(state, x, decays):
            m = nnx.merge(gdef, state)
            if decays is None:
                return m(x, positions, segment_ids, valid)
            return m(x, positions, segment_ids, valid, decays)

        return remat(f, self.remat_policy)(state, x, decays)

    def layer_list(self):
        """[(global index, DecoderLayer)] in order; scanned layers are sliced out of the stack (with
        their own GLA decay constants: the stack keeps one group's)."""
        if not self.scan:
            return list(enumerate(self.layers))
        out = list(enumerate(self.prefix))
        if self.num_groups:
            gdef, stacked = nnx.split(self.groups)
            decays = np.asarray(self.group_decays, np.float32).reshape(self.num_groups, self.group_size, -1)
            for g in range(self.num_groups):
                group = nnx.merge(gdef, jax.tree.map(lambda v: v[g], stacked))
                for j, layer in enumerate(group.layers):
                    if layer.attn_type == "gla":
                        layer.attention.log_decay = tuple(float(d) for d in decays[g, j])
                    out.append((len(self.prefix) + g * self.group_size + j, layer))
        p = self.num_layers_before_suffix()
        return out + [(p + j, layer) for j, layer in enumerate(self.suffix)]

    def init_cache(self, batch: int, max_len: int) -> dict:
        """Decode caches {layer index: cache}: MLA latent KV of `max_len` slots, GLA recurrent state."""
        return {i: layer.init_cache(batch, max_len) for i, layer in self.layer_list()}

    def decode(self, ids_BT, positions_BT, cache: dict):
        """Runs T new tokens (prefill or one step) against `cache`, one document per row.

        Returns (DecoderOutput, new cache). Scanned models run their layers one by one here.
        """
        x = self.embed(ids_BT)
        segment_ids_BT = jnp.ones(ids_BT.shape, jnp.int32)
        aux, new = {}, {}
        for i, layer in self.layer_list():
            x, aux[i], new[i] = layer(x, positions_BT, segment_ids_BT, cache=cache[i])
        return self._head(x, aux), new

    def _head(self, x, aux) -> DecoderOutput:
        moe_aux = {i: a for i, a in sorted(aux.items()) if a is not None}
        hidden = self.final_norm(x)
        logits = self.embed.attend(hidden, jnp.dtype(self.logits_dtype)) if self.tied else self.lm_head(hidden)
        return DecoderOutput(logits=logits, hidden_pre_norm=x, hidden=hidden, moe_aux=moe_aux)

    def __call__(self, ids_BT, positions_BT=None, segment_ids_BT=None, valid_BT=None) -> DecoderOutput:
        B, T = ids_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        x = self.embed(ids_BT)
        aux = {}
        run = lambda m, x: self._run(m, x, positions_BT, segment_ids_BT, valid_BT)
        if not self.scan:
            for i, layer in enumerate(self.layers):
                x, aux[i] = run(layer, x)
        else:
            p = len(self.prefix)
            for i, layer in enumerate(self.prefix):
                x, aux[i] = run(layer, x)
            if self.num_groups:
                n, k = self.num_groups, self.group_size
                gdef, stacked = nnx.split(self.groups)
                decays = jnp.asarray(self.group_decays, jnp.float32).reshape(n, k, self.num_heads)

                def body(x, xs):
                    state, d = xs
                    return self._run(nnx.merge(gdef, state), x, positions_BT, segment_ids_BT, valid_BT, d)

                x, group_aux = jax.lax.scan(body, x, (stacked, decays))
                for j, a in enumerate(group_aux):
                    for g in range(n):
                        aux[p + g * k + j] = None if a is None else jax.tree.map(lambda v: v[g], a)
            for j, layer in enumerate(self.suffix):
                x, aux[self.num_layers_before_suffix() + j] = run(layer, x)
        return self._head(x, aux)

    def num_layers_before_suffix(self) -> int:
        return len(self.prefix) + self.num_groups * self.group_size


DECODERS = {DecoderBlockType.LING2: Ling2Decoder}


def build_decoder(cfg, *, rngs: nnx.Rngs):
    """The decoder registered for cfg.decoder_block."""
    try:
        cls = DECODERS[DecoderBlockType(cfg.decoder_block)]
    except (KeyError, ValueError):
        raise ValueError(f"decoder_block: no decoder registered for {cfg.decoder_block!r}") from None
    return cls(cfg, rngs=rngs)
