"""The Ling2 decoder stack: embed -> layers -> final RMSNorm -> untied lm_head.

Each layer is pre-norm: x += attn(norm(x)); x += mlp(norm(x)), its attention and MLP kinds
and its place in the state given by the layer plan (`ling2.layers.plan`). Attention
modules are looked up by kind in `ling2.layers.attention.ATTENTION`. Calling the decoder is the training forward;
`init_cache` / `decode` / `accept` / `unpack` are cached decoding (`ling2.layers.decode`).

With `scan_layers`, the plan's scanned groups keep their parameters stacked on a leading
"layers" axis and run under one `lax.scan`; the prefix and suffix run one by one. GLA slopes
depend on the global layer index, so each scanned group gets its own as a scan input.
Layers are built in index order in both modes, so one seed gives the same weights scanned
or not. `remat_policy`: none, full (recompute all), save_dot (keep the outputs of weight
matmuls, recompute the rest).
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.config import DecoderBlockType
from ling2.layers import decode as decode_lib
from ling2.layers import losses, norms
from ling2.layers.attention import ATTENTION
from ling2.layers.attention_gla import layer_slopes
from ling2.layers.embed import Embed, LMHead
from ling2.layers.moe import MoE
from ling2.layers.moe_experts import Mlp
from ling2.layers.plan import LayerSpec, layer_plan
from ling2.layers.sharding import constrain, dim_shards

ACT = ("activation_batch", "activation_length", "activation_embed")
MODES = ("prefill", "step")  # cached decoding (ling2.layers.decode)


class DecoderOutput(NamedTuple):
    logits: Optional[jax.Array]  # [B, T, V], fp32 when cfg.float32_logits; None when not asked for
    hidden_pre_norm: jax.Array  # [B, T, E], last layer output
    hidden: jax.Array  # [B, T, E], after the final norm (what MTP and the lm_head consume)
    moe_aux: dict  # {layer index: MoEAux} for every MoE layer


class DecoderLayer(nnx.Module):
    """One pre-norm block of `spec.attn` attention and a `spec.mlp` MLP (dense or moe)."""

    def __init__(self, cfg, spec: LayerSpec, *, rngs: nnx.Rngs):
        eps, wdt = cfg.normalization_layer_epsilon, jnp.dtype(cfg.weight_dtype)
        self.attn_type, self.mlp_type = spec.attn, spec.mlp
        self.input_norm = norms.RMSNorm(cfg.emb_dim, eps=eps, param_dtype=wdt)
        if spec.attn not in ATTENTION:
            raise ValueError(f"layer {spec.index}: unknown attention type {spec.attn!r} (known: {sorted(ATTENTION)})")
        self.attention = ATTENTION[spec.attn].module(cfg, spec.index, rngs=rngs)
        self.post_attention_norm = norms.RMSNorm(cfg.emb_dim, eps=eps, param_dtype=wdt)
        if spec.mlp == "dense":
            self.mlp = Mlp(cfg, cfg.mlp_dim, rngs=rngs)
        elif spec.mlp == "moe":
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            raise ValueError(f"layer {spec.index}: unknown mlp type {spec.mlp!r}")

    def _block(self, x_BTE, attend, valid_BT):
        """x + attend(norm(x)), then the MLP: (x [B,T,E], MoEAux or None)."""
        a = attend(self.input_norm(x_BTE))
        h = constrain(x_BTE + a.astype(x_BTE.dtype), ACT)
        aux = None
        if self.mlp_type == "moe":
            y, aux = self.mlp(self.post_attention_norm(h), valid_BT)
        else:
            y = self.mlp(self.post_attention_norm(h))
        return constrain(h + y.astype(h.dtype), ACT), aux

    def __call__(self, x_BTE, positions_BT, segment_ids_BT, valid_BT=None, log_decay=None):
        """Training forward: (x [B,T,E], MoEAux or None). `log_decay`: a GLA layer's [H] log-decays when they
        are traced values (scanned groups)."""
        extra = {} if log_decay is None else {"log_decay": log_decay}
        return self._block(x_BTE, lambda h: self.attention(h, positions_BT, segment_ids_BT, **extra), valid_BT)

    def init_cache(self, batch: int, max_len: int):
        return self.attention.init_cache(batch, max_len)

    def decode(self, mode: str, x_BTE, positions_BT, segment_ids_BT, valid_BT, cache, state, opts):
        """A cached call (`ling2.layers.decode`): mode "prefill" or "step" of the attention kind. Returns
        (x [B,T,E], MoEAux or None, the attention's new cache)."""
        if mode not in MODES:
            raise ValueError(f"decode mode {mode!r}: expected one of {MODES}")
        new = []

        def attend(h):
            a, c = getattr(self.attention, mode)(h, positions_BT, segment_ids_BT, cache, state, opts)
            new.append(c)
            return a

        x, aux = self._block(x_BTE, attend, valid_BT)
        return x, aux, new[0]


class LayerGroup(nnx.Module):
    """Consecutive layers, one scan step (the decoder runs them one by one, each under its own remat)."""

    def __init__(self, layers):
        self.layers = nnx.List(layers)


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
        plan = layer_plan(cfg)
        self.remat_policy, self.scan = cfg.remat_policy, plan.scan
        self.embed = Embed(cfg, rngs=rngs)
        layers = [DecoderLayer(cfg, spec, rngs=rngs) for spec in plan.layers]
        if self.scan:
            p, n, k = plan.prefix, plan.num_groups, plan.group_size
            self.prefix = nnx.List(layers[:p])
            self.suffix = nnx.List(layers[plan.suffix_start:])
            self.num_groups, self.group_size = n, k
            self.groups = _stack([LayerGroup(layers[p + g * k:p + (g + 1) * k]) for g in range(n)]) if n else None
            # Per-group, per-position GLA log-decays [n, k, H] (rows of other kinds unused).
            decays = np.zeros((max(n, 1), k, cfg.num_query_heads), np.float32)
            for spec in plan.layers:
                if spec.stack and spec.attn == "gla":
                    decays[spec.stack[0], spec.path[-1]] = -layer_slopes(
                        cfg.num_query_heads, spec.index, cfg.num_decoder_layers, cfg.gla_slope_layer_offset)
            self.group_decays = tuple(map(tuple, decays.reshape(max(n, 1), -1).tolist()))
        else:
            self.layers = nnx.List(layers)
        self.final_norm = norms.RMSNorm(cfg.emb_dim, eps=cfg.normalization_layer_epsilon,
                                        param_dtype=jnp.dtype(cfg.weight_dtype))
        self.tied = cfg.logits_via_embedding
        self.logits_dtype = "float32" if cfg.float32_logits else cfg.dtype
        self.lm_head = None if self.tied else LMHead(cfg, rngs=rngs)
        self.num_heads = cfg.num_query_heads
        self.loss_vocab_blocks, self.dtype, self.vocab_size = cfg.loss_vocab_blocks, cfg.dtype, cfg.vocab_size

    def _run(self, module, x, positions, segment_ids, valid, decays=None):
        """Applies a layer functionally, under the remat policy (`decays`: a GLA layer's traced log-decays)."""
        gdef, state = nnx.split(module)

        def f(state, x, decays):
            m = nnx.merge(gdef, state)
            if decays is None:
                return m(x, positions, segment_ids, valid)
            return m(x, positions, segment_ids, valid, log_decay=decays)

        return remat(f, self.remat_policy)(state, x, decays)

    def layer_list(self):
        """[(global index, DecoderLayer)] in order; scanned layers are sliced out of the stack (with
        their own GLA decay constants: the stack keeps one group's)."""
        if not self.scan:
            return list(enumerate(self.layers))
        out = list(enumerate(self.prefix))
        p, n, k = len(self.prefix), self.num_groups, self.group_size
        if n:
            gdef, stacked = nnx.split(self.groups)
            decays = np.asarray(self.group_decays, np.float32).reshape(n, k, -1)
            for g in range(n):
                group = nnx.merge(gdef, jax.tree.map(lambda v: v[g], stacked))
                for j, layer in enumerate(group.layers):
                    if layer.attn_type == "gla":
                        layer.attention.log_decay = tuple(float(d) for d in decays[g, j])
                    out.append((p + g * k + j, layer))
        return out + [(p + n * k + j, layer) for j, layer in enumerate(self.suffix)]

    def init_cache(self, batch: int, max_len: int) -> decode_lib.DecoderCache:
        """An empty decode cache of `max_len` slots per row (`ling2.layers.decode`), with every layer's own."""
        layers = {i: layer.init_cache(batch, max_len) for i, layer in self.layer_list()}
        return decode_lib.empty(batch, max_len, layers)

    def decode(self, mode: str, ids_BT, positions_BT, cache: decode_lib.DecoderCache, segment_ids_BT=None,
               return_logits: bool = True, opts: decode_lib.DecodeOptions = decode_lib.DecodeOptions()):
        """Runs T new tokens per row against `cache`, written from each row's cache index on: mode "prefill"
        (rows with empty caches) or "step" (continue every row). segment_ids_BT: document ids (default 1; 0
        marks padding that nothing attends to). Returns (DecoderOutput, new cache). Scanned models run their
        layers one by one here."""
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones(ids_BT.shape, jnp.int32)
        state = decode_lib.begin(cache, segment_ids_BT)
        x = self.embed(ids_BT)
        aux, new = {}, {}
        for i, layer in self.layer_list():
            x, aux[i], new[i] = layer.decode(mode, x, positions_BT, segment_ids_BT, segment_ids_BT != 0,
                                             cache.layers[i], state, opts)
        return self._head(x, aux, return_logits), decode_lib.end(state, ids_BT.shape[1], new)

    def accept(self, old: decode_lib.DecoderCache, new: decode_lib.DecoderCache, keep_B, live_B):
        """The cache after a "step" with opts.history of which each live row keeps its new tokens 0..keep_B
        (speculative decoding's accepted drafts): its index moves past them and every layer is as after token
        keep_B; rows not live are left as in `old`."""
        index = old.index + jnp.where(live_B, keep_B + 1, 0)
        layers = {i: layer.attention.accept(old.layers[i], new.layers[i], keep_B, live_B)
                  for i, layer in self.layer_list()}
        return decode_lib.DecoderCache(index, new.segment, layers)

    def unpack(self, packed: decode_lib.DecoderCache, gather: decode_lib.Gather, max_len: int):
        """A cache of one prompt per row in the padded layout [B, T] of `gather`, from a "prefill" of packed rows
        with opts.packed_docs: every layer's values moved to the prompts' rows and slots."""
        B, T = gather.row.shape
        empty = self.init_cache(B, max_len)
        layers = {i: layer.attention.unpack(packed.layers[i], empty.layers[i], gather)
                  for i, layer in self.layer_list()}
        segment = empty.segment.at[:, :T].set((gather.row >= 0).astype(jnp.int32))
        return decode_lib.DecoderCache(jnp.full((B,), T, jnp.int32), segment, layers)

    def logits(self, hidden_BTE):
        """Output logits [B, T, V] of final-normed hidden states."""
        return self.embed.attend(hidden_BTE, jnp.dtype(self.logits_dtype)) if self.tied else self.lm_head(hidden_BTE)

    def ce_sums(self, hidden_BTE, targets_BT, weights_BT):
        """(CE sum, weight sum, argmax-hit sum) of the output head over final-normed hidden states. With
        cfg.loss_vocab_blocks > 0 the [B,T,V] logits are never held (`losses.head_cross_entropy_sums`);
        with 0 they are the `logits` of this module."""
        if not self.loss_vocab_blocks:
            return losses.cross_entropy_sums(self.logits(hidden_BTE), targets_BT, weights_BT)
        kernel = self.embed.embedding[...] if self.tied else self.lm_head.kernel[...]
        return losses.head_cross_entropy_sums(
            hidden_BTE, kernel, targets_BT, weights_BT, num_blocks=self.loss_vocab_blocks,
            vocab_shards=dim_shards("vocab", self.vocab_size), compute_dtype=self.dtype,
            logits_dtype=self.logits_dtype, tied=self.tied)

    def _head(self, x, aux, return_logits: bool = True) -> DecoderOutput:
        moe_aux = {i: a for i, a in sorted(aux.items()) if a is not None}
        hidden = self.final_norm(x)
        logits = self.logits(hidden) if return_logits else None
        return DecoderOutput(logits=logits, hidden_pre_norm=x, hidden=hidden, moe_aux=moe_aux)

    def __call__(self, ids_BT, positions_BT=None, segment_ids_BT=None, valid_BT=None,
                 return_logits: bool = True) -> DecoderOutput:
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
            p, n, k = len(self.prefix), self.num_groups, self.group_size
            for i, layer in enumerate(self.prefix):
                x, aux[i] = run(layer, x)
            if n:
                gdef, stacked = nnx.split(self.groups)
                decays = jnp.asarray(self.group_decays, jnp.float32).reshape(n, k, self.num_heads)

                def body(x, xs):
                    # Each layer under its own remat, as unscanned layers are: the backward then recomputes
                    # and holds one layer's activations at a time, not the whole group's.
                    state, d = xs
                    auxes = []
                    for j, layer in enumerate(nnx.merge(gdef, state).layers):
                        x, a = self._run(layer, x, positions_BT, segment_ids_BT, valid_BT,
                                         d[j] if layer.attn_type == "gla" else None)
                        auxes.append(a)
                    return x, auxes

                x, group_aux = jax.lax.scan(body, x, (stacked, decays))
                for j, a in enumerate(group_aux):
                    for g in range(n):
                        aux[p + g * k + j] = None if a is None else jax.tree.map(lambda v: v[g], a)
            for j, layer in enumerate(self.suffix):
                x, aux[p + n * k + j] = run(layer, x)
        return self._head(x, aux, return_logits)


DECODERS = {DecoderBlockType.LING2: Ling2Decoder}


def build_decoder(cfg, *, rngs: nnx.Rngs):
    """The decoder registered for cfg.decoder_block."""
    try:
        cls = DECODERS[DecoderBlockType(cfg.decoder_block)]
    except (KeyError, ValueError):
        raise ValueError(f"decoder_block: no decoder registered for {cfg.decoder_block!r}") from None
    return cls(cfg, rngs=rngs)
