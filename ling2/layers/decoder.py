"""The Ling2 decoder stack: embed -> layers -> final RMSNorm -> untied lm_head.

Built from a `ModelSpec` (`ling2.layers.spec`). Each layer is pre-norm: x += attn(norm(x));
x += mlp(norm(x)), its attention and MLP kinds and its place in the state given by the layer plan
(`ling2.layers.plan`). Attention
modules are looked up by kind in `ling2.layers.attention.registry.ATTENTION`. Calling the decoder is the training forward;
`init_cache` / `decode` / `accept` / `unpack` are cached decoding (`ling2.layers.attention.decode`).

The layers sit in a `LayerStack` (`ling2.layers.stack`): with `scan_layers`, the plan's scanned
groups keep their parameters stacked on a leading "layers" axis and run under one `lax.scan`,
the rest one by one, all through one call path that gives each layer its global index. Layers
are built in index order in both modes, so one seed gives the same weights scanned or not.
`run.remat_policy`: none, full (recompute all), save_dot (keep the outputs of weight matmuls,
recompute the rest).
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ling2.layers.attention import decode as decode_lib
from ling2.layers import losses, norms, pipeline
from ling2.layers.attention.registry import ATTENTION
from ling2.layers.embed import Embed, LMHead
from ling2.layers.moe.layer import MoE
from ling2.layers.moe.experts import Mlp
from ling2.layers.plan import LayerSpec
from ling2.layers.sharding import constrain, dim_shards
from ling2.layers.spec import LayerSpecs, ModelSpec
from ling2.layers.stack import LayerStack

ACT = ("activation_batch", "activation_length", "activation_embed")
MODES = ("prefill", "step")  # cached decoding (ling2.layers.attention.decode)


class DecoderOutput(NamedTuple):
    logits: Optional[jax.Array]  # [B, T, V], fp32 when float32_logits; None when not asked for
    hidden_pre_norm: jax.Array  # [B, T, E], last layer output
    hidden: jax.Array  # [B, T, E], after the final norm (what MTP and the lm_head consume)
    moe_aux: dict  # {layer index: MoEAux} for every MoE layer


class DecoderLayer(nnx.Module):
    """One pre-norm block of `layer.attn` attention and a `layer.mlp` MLP (dense or moe)."""

    def __init__(self, specs: LayerSpecs, layer: LayerSpec, *, rngs: nnx.Rngs):
        w = specs.weights
        eps, wdt = w.normalization_layer_epsilon, jnp.dtype(w.weight_dtype)
        self.attn_type, self.mlp_type, self.run = layer.attn, layer.mlp, w.run
        self.input_norm = norms.RMSNorm(w.emb_dim, eps=eps, param_dtype=wdt)
        if layer.attn not in ATTENTION:
            raise ValueError(f"layer {layer.index}: unknown attention type {layer.attn!r} (known: {sorted(ATTENTION)})")
        self.attention = ATTENTION[layer.attn].module(specs.attention_spec(layer.attn), rngs=rngs)
        self.post_attention_norm = norms.RMSNorm(w.emb_dim, eps=eps, param_dtype=wdt)
        if layer.mlp == "dense":
            self.mlp = Mlp(w, specs.mlp_dim, rngs=rngs)
        elif layer.mlp == "moe":
            self.mlp = MoE(specs.moe, rngs=rngs)
        else:
            raise ValueError(f"layer {layer.index}: unknown mlp type {layer.mlp!r}")

    def _block(self, x_BTE, attend, valid_BT):
        """x + attend(norm(x)), then the MLP: (x [B,T,E], MoEAux or None)."""
        a = attend(self.input_norm(x_BTE))
        h = constrain(x_BTE + a.astype(x_BTE.dtype), ACT, self.run)
        aux = None
        if self.mlp_type == "moe":
            y, aux = self.mlp(self.post_attention_norm(h), valid_BT)
        else:
            y = self.mlp(self.post_attention_norm(h))
        return constrain(h + y.astype(h.dtype), ACT, self.run), aux

    def __call__(self, x_BTE, positions_BT, segment_ids_BT, valid_BT=None, *, layer_index):
        """Training forward: (x [B,T,E], MoEAux or None). `layer_index`: the global index (traced in a
        scanned group)."""
        attend = lambda h: self.attention(h, positions_BT, segment_ids_BT, layer_index=layer_index)  # noqa: E731
        return self._block(x_BTE, attend, valid_BT)

    def init_cache(self, batch: int, max_len: int):
        return self.attention.init_cache(batch, max_len)

    def decode(self, mode: str, x_BTE, positions_BT, segment_ids_BT, valid_BT, cache, state, opts, *, layer_index):
        """A cached call (`ling2.layers.attention.decode`): mode "prefill" or "step" of the attention kind. Returns
        (x [B,T,E], MoEAux or None, the attention's new cache)."""
        if mode not in MODES:
            raise ValueError(f"decode mode {mode!r}: expected one of {MODES}")
        new = []

        def attend(h):
            call = self.attention.prefill if mode == "prefill" else self.attention.step
            a, c = call(h, positions_BT, segment_ids_BT, cache, state, opts, layer_index=layer_index)
            new.append(c)
            return a

        x, aux = self._block(x_BTE, attend, valid_BT)
        return x, aux, new[0]


def remat(fn, policy: str):
    """Wraps fn in jax.checkpoint by run.remat_policy."""
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if policy == "save_dot":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"remat_policy: unknown {policy!r} (none, full, save_dot)")


class Ling2Decoder(LayerStack):
    """Ling2 decoder. Call with ids [B,T], optional positions / segment_ids / valid [B,T]."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        self.run = spec.run
        self.embed = Embed(spec.embed, rngs=rngs)
        self.init_layers(spec.plan, [DecoderLayer(spec.layers, layer, rngs=rngs) for layer in spec.plan.layers])
        w = spec.layers.weights
        self.final_norm = norms.RMSNorm(w.emb_dim, eps=w.normalization_layer_epsilon,
                                        param_dtype=jnp.dtype(w.weight_dtype))
        self.tied, self.logits_dtype = spec.tied, spec.logits_dtype
        self.lm_head = None if self.tied else LMHead(spec.embed, rngs=rngs)
        self.dtype, self.vocab_size = spec.dtype, spec.vocab_size

    def _run(self, layer, layer_index, x, positions, segment_ids, valid):
        """Applies a layer functionally, under the remat policy (each layer under its own, scanned or not: the
        backward then recomputes and holds one layer's activations at a time)."""
        gdef, state = nnx.split(layer)

        def f(state, x, layer_index):
            return nnx.merge(gdef, state)(x, positions, segment_ids, valid, layer_index=layer_index)

        if isinstance(layer_index, int):  # a constant, not an argument jax.checkpoint would trace
            return remat(lambda state, x: f(state, x, layer_index), self.run.remat_policy)(state, x)
        return remat(f, self.run.remat_policy)(state, x, layer_index)

    def init_cache(self, batch: int, max_len: int) -> decode_lib.DecoderCache:
        """An empty decode cache of `max_len` slots per row (`ling2.layers.attention.decode`), with every layer's own."""
        layers = {i: layer.init_cache(batch, max_len) for i, layer in self.unstacked()}
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
        for i, layer in self.unstacked():
            x, aux[i], new[i] = layer.decode(mode, x, positions_BT, segment_ids_BT, segment_ids_BT != 0,
                                             cache.layers[i], state, opts, layer_index=i)
        return self._head(x, aux, return_logits), decode_lib.end(state, ids_BT.shape[1], new)

    def accept(self, old: decode_lib.DecoderCache, new: decode_lib.DecoderCache, keep_B, live_B):
        """The cache after a "step" with opts.history of which each live row keeps its new tokens 0..keep_B
        (speculative decoding's accepted drafts): its index moves past them and every layer is as after token
        keep_B; rows not live are left as in `old`."""
        index = old.index + jnp.where(live_B, keep_B + 1, 0)
        layers = {i: layer.attention.accept(old.layers[i], new.layers[i], keep_B, live_B)
                  for i, layer in self.unstacked()}
        return decode_lib.DecoderCache(index, new.segment, layers)

    def unpack(self, packed: decode_lib.DecoderCache, gather: decode_lib.Gather, max_len: int):
        """A cache of one prompt per row in the padded layout [B, T] of `gather`, from a "prefill" of packed rows
        with opts.packed_docs: every layer's values moved to the prompts' rows and slots."""
        B, T = gather.row.shape
        empty = self.init_cache(B, max_len)
        layers = {i: layer.attention.unpack(packed.layers[i], empty.layers[i], gather)
                  for i, layer in self.unstacked()}
        segment = empty.segment.at[:, :T].set((gather.row >= 0).astype(jnp.int32))
        return decode_lib.DecoderCache(jnp.full((B,), T, jnp.int32), segment, layers)

    def logits(self, hidden_BTE):
        """Output logits [B, T, V] of final-normed hidden states."""
        return self.embed.attend(hidden_BTE, jnp.dtype(self.logits_dtype)) if self.tied else self.lm_head(hidden_BTE)

    def ce_sums(self, hidden_BTE, targets_BT, weights_BT):
        """(CE sum, weight sum, argmax-hit sum) of the output head over final-normed hidden states. With
        run.loss_vocab_blocks > 0 the [B,T,V] logits are never held (`losses.head_cross_entropy_sums`);
        with 0 they are the `logits` of this module."""
        if not self.run.loss_vocab_blocks:
            return losses.cross_entropy_sums(self.logits(hidden_BTE), targets_BT, weights_BT)
        kernel = self.embed.embedding[...] if self.tied else self.lm_head.kernel[...]
        return losses.head_cross_entropy_sums(
            hidden_BTE, kernel, targets_BT, weights_BT, num_blocks=self.run.loss_vocab_blocks,
            vocab_shards=dim_shards(self.run, "vocab", self.vocab_size), compute_dtype=self.dtype,
            logits_dtype=self.logits_dtype, tied=self.tied, run=self.run)

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
        run = lambda layer, i, x, extras: self._run(layer, i, x, *extras)  # noqa: E731
        x, aux = self.fold(run, self.embed(ids_BT), (positions_BT, segment_ids_BT, valid_BT), self.run)
        if pipeline.stages(self.run) > 1:  # the scanned layers' MoE losses, summed over their parts: their mean
            n = pipeline.parts(self.run, B)
            aux = {i: a if a is None or not self.scanned(i) else
                   a.replace(lb_loss=a.lb_loss / n, z_loss=a.z_loss / n) for i, a in aux.items()}
        return self._head(x, aux, return_logits)

