"""Multi-token prediction (next-n layers, DeepSeek-V3 / BailingMoeV2_5 style), for training.

Depth k = 1..K predicts the token k+1 ahead of each position:

  h_0 = main hidden [B,T,E] (after the final norm; before it with cfg.mtp_hidden_pre_norm)
  x_k = W_eh [RMSNorm_e(embed(ids shifted left by k)) ; RMSNorm_h(h_{k-1})]     [B,T,2E] -> [B,T,E]
  y_k = DecoderLayer(MLA + MoE, layer index L + k - 1)(x_k)
  h_k = RMSNorm_final(y_k)            (h_k = y_k is passed on instead with mtp_hidden_pre_norm)
  logits_k = shared lm_head(RMSNorm_final(y_k)),  target = targets shifted left by k

Shifts stay inside each packed document (`roll_and_mask_by_segment`): a position whose
shifted token lies in another document or past the row end is fed `fill` and dropped from
the loss. Each depth returns sums (CE, token count, correct argmax) so the trainer can
normalise per depth under gradient accumulation; `mtp_loss` and `top1_accuracy` turn
the sums into the loss and the teacher-forced top-1 accuracy (not the acceptance rate of
speculative decoding, whose inputs are drafts: `ling2.infer.generation` measures that).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ling2.layers.attention import decode as decode_lib
from ling2.layers import losses, norms
from ling2.kernels import fp8
from ling2.layers.decoder import DecoderLayer, DecoderOutput, remat
from ling2.layers.plan import LayerSpec
from ling2.layers.spec import LayerSpecs, ModelSpec


def roll_and_mask_by_segment(x_BT, segment_ids_BT, k: int, fill=0):
    """Shifts x left by k inside each document. Returns (rolled [B,T], valid [B,T] bool).

    A document is a maximal run of equal segment ids (a repeated id after a different one is
    a new document). valid[b,t] is True iff t+k < T and t+k lies in t's document; elsewhere
    rolled holds `fill`, never a token of another document.
    """
    if x_BT.ndim != 2 or x_BT.shape != segment_ids_BT.shape:
        raise ValueError(f"roll_and_mask_by_segment: x {x_BT.shape} and segment_ids {segment_ids_BT.shape} "
                         "must both be [B, T]")
    if k < 0:
        raise ValueError(f"roll_and_mask_by_segment: k must be >= 0, got {k}")
    B, T = x_BT.shape
    seg = jnp.asarray(segment_ids_BT)
    starts = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), (seg[:, 1:] != seg[:, :-1]).astype(jnp.int32)], axis=1)
    doc_BT = jnp.cumsum(starts, axis=1)

    def shift(a, v):
        return jnp.concatenate([a[:, k:], jnp.full((B, min(k, T)), v, a.dtype)], axis=1)

    valid_BT = shift(doc_BT, -1) == doc_BT
    rolled_BT = jnp.where(valid_BT, shift(x_BT, fill), jnp.asarray(fill, x_BT.dtype))
    return rolled_BT, valid_BT


def depth_loss_weights(loss_weights_BT, segment_ids_BT, k: int):
    """Depth k's loss weights [B,T] fp32: the main weights shifted by k, 0 where the shift leaves the document."""
    w_k, ok = roll_and_mask_by_segment(loss_weights_BT, segment_ids_BT, k)
    return jnp.where(ok, w_k, 0).astype(jnp.float32)


def depth_token_counts(loss_weights_BT, segment_ids_BT, num_depths: int):
    """[K] the per-depth token counts MTP will report as `ce_count`, without running the model
    (e.g. to normalise by the whole step's tokens under calculate_per_token_loss)."""
    return jnp.stack([jnp.sum(depth_loss_weights(loss_weights_BT, segment_ids_BT, k))
                      for k in range(1, num_depths + 1)])


def mtp_loss(ce_sum_K, ce_count_K, scaling):
    """scaling * mean over depths of each depth's token-averaged CE (a depth with no tokens adds 0)."""
    return scaling * jnp.mean(ce_sum_K / jnp.maximum(ce_count_K, 1))


def top1_accuracy(correct_K, count_K):
    """Per depth [K]: fraction of counted positions whose argmax is the true token k+1 ahead, given
    the true tokens in between (teacher forcing)."""
    return correct_K / jnp.maximum(count_K, 1)


class MTPOutput(NamedTuple):
    ce_sum: jax.Array  # [K] fp32, sum over positions of loss_weight * CE
    ce_count: jax.Array  # [K] fp32, sum of the depth's loss weights
    correct: jax.Array  # [K] fp32, loss-weighted count of argmax == target
    moe_aux: dict  # {global layer index: MoEAux}
    logits: tuple | None = None  # K arrays [B,T,V], only with return_logits


class MTPDepth(nnx.Module):
    """One next-n module: enorm, hnorm, eh_proj [2E, E], a MLA + MoE DecoderLayer, final norm."""

    def __init__(self, specs: LayerSpecs, layer: LayerSpec, *, rngs: nnx.Rngs):
        w = specs.weights
        E, eps, wdt = w.emb_dim, w.normalization_layer_epsilon, jnp.dtype(w.weight_dtype)
        self.enorm = norms.RMSNorm(E, eps=eps, param_dtype=wdt)
        self.hnorm = norms.RMSNorm(E, eps=eps, param_dtype=wdt)
        init = nnx.initializers.normal(w.init_std)
        self.eh_proj = nnx.Param(init(rngs.params(), (2 * E, E), wdt), out_sharding=("embed", None),
                                 eager_sharding=False)
        self.layer = DecoderLayer(specs, layer, rngs=rngs)
        self.index = layer.index
        self.final_norm = norms.RMSNorm(E, eps=eps, param_dtype=wdt)
        self.dtype, self.fp8 = w.dtype, fp8.of(w.run)

    def _input(self, emb_BTE, h_BTE):
        x = jnp.concatenate([self.enorm(emb_BTE), self.hnorm(h_BTE.astype(emb_BTE.dtype))], axis=-1)
        w = self.eh_proj[...].astype(jnp.dtype(self.dtype))
        return fp8.einsum("btf,fe->bte", x.astype(w.dtype), w, self.fp8)

    def __call__(self, emb_BTE, h_BTE, positions_BT, segment_ids_BT, valid_BT):
        """Training forward: (block output before the final norm, after it, MoEAux), all [B,T,E] but the aux."""
        y, aux = self.layer(self._input(emb_BTE, h_BTE), positions_BT, segment_ids_BT, valid_BT,
                            layer_index=self.index)
        return y, self.final_norm(y), aux

    def decode(self, mode: str, emb_BTE, h_BTE, positions_BT, segment_ids_BT, valid_BT, cache, state, opts):
        """A cached call of the depth's layer (`DecoderLayer.decode`): (y, y normed, MoEAux, the layer's cache)."""
        y, aux, cache = self.layer.decode(mode, self._input(emb_BTE, h_BTE), positions_BT, segment_ids_BT, valid_BT,
                                          cache, state, opts, layer_index=self.index)
        return y, self.final_norm(y), aux, cache


class MTP(nnx.Module):
    """The plan's MTP depths (mtp_num_layers next-n modules); the embedding and the output head are the main
    decoder's."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        if not spec.plan.mtp:
            raise ValueError("mtp_num_layers: MTP needs >= 1 layer (Ling2Model builds none for 0)")
        self.first_layer_idx = len(spec.plan.layers)
        self.depths = nnx.List([MTPDepth(spec.layers, layer, rngs=rngs) for layer in spec.plan.mtp])
        self.pre_norm = spec.mtp_hidden_pre_norm
        self.remat_policy = spec.run.remat_policy

    def __call__(self, decoder, hidden, ids_BT, targets_BT, loss_weights_BT, positions_BT, segment_ids_BT,
                 valid_BT=None, return_logits: bool = False) -> MTPOutput:
        """Runs every depth; returns per-depth loss sums.

        hidden: the main model's DecoderOutput (its `hidden`, or `hidden_pre_norm` with
          mtp_hidden_pre_norm, is used), or that [B,T,E] array chosen by the caller.
        decoder: the main Ling2Decoder, whose embedding and output head (`logits`, `ce_sums`) MTP shares.
        ids, targets, loss_weights, positions, segment_ids: the main model's [B,T] inputs
          (targets[t] is the token after ids[t]); valid_BT: optional MoE statistics mask.
        """
        if isinstance(hidden, DecoderOutput):
            hidden = hidden.hidden_pre_norm if self.pre_norm else hidden.hidden
        if hidden.shape[:2] != ids_BT.shape:
            raise ValueError(f"MTP: hidden {hidden.shape} does not match ids {ids_BT.shape}")
        h = hidden
        sums, counts, corrects, all_logits, moe_aux = [], [], [], [], {}
        for k, depth in enumerate(self.depths, start=1):
            ids_k, ok = roll_and_mask_by_segment(ids_BT, segment_ids_BT, k)
            targets_k, _ = roll_and_mask_by_segment(targets_BT, segment_ids_BT, k)
            w_k = depth_loss_weights(loss_weights_BT, segment_ids_BT, k)
            moe_valid = ok if valid_BT is None else ok & valid_BT.astype(bool)

            gdef, state = nnx.split(depth)

            def f(state, emb, h, gdef=gdef):
                return nnx.merge(gdef, state)(emb, h, positions_BT, segment_ids_BT, moe_valid)

            emb = decoder.embed(ids_k)
            y, y_normed, moe_aux[self.first_layer_idx + k - 1] = remat(f, self.remat_policy)(state, emb, h)
            h = y if self.pre_norm else y_normed
            if return_logits:
                logits = decoder.logits(y_normed).astype(jnp.float32)
                ce, count, correct = losses.cross_entropy_sums(logits, targets_k, w_k)
            else:
                ce, count, correct = decoder.ce_sums(y_normed, targets_k, w_k)
            sums.append(ce)
            counts.append(count)
            corrects.append(correct)
            if return_logits:
                all_logits.append(logits)
        return MTPOutput(ce_sum=jnp.stack(sums), ce_count=jnp.stack(counts), correct=jnp.stack(corrects),
                         moe_aux=moe_aux, logits=tuple(all_logits) if return_logits else None)

    # ---- cached decoding (speculative drafts; ling2.layers.attention.decode) ----

    def init_cache(self, k: int, batch: int, max_len: int) -> decode_lib.DecoderCache:
        """Depth k's (1-based) empty cache; its `layers` is the depth's one layer cache."""
        return decode_lib.empty(batch, max_len, self.depths[k - 1].layer.init_cache(batch, max_len))

    def decode(self, k: int, mode: str, decoder, ids_BT, h_BTE, positions_BT, segment_ids_BT,
               cache: decode_lib.DecoderCache, opts: decode_lib.DecodeOptions):
        """Depth k (1-based) on `ids_BT`, the tokens k ahead of each position, and `h_BTE`, depth k-1's hidden
        state (the main model's for k = 1). Returns (the hidden state depth k+1 consumes, y normed [B,T,E] for
        the output head, new cache)."""
        state = decode_lib.begin(cache, segment_ids_BT)
        y, y_normed, _, layer_cache = self.depths[k - 1].decode(
            mode, decoder.embed(ids_BT), h_BTE, positions_BT, segment_ids_BT, segment_ids_BT != 0, cache.layers,
            state, opts)
        return (y if self.pre_norm else y_normed), y_normed, decode_lib.end(state, ids_BT.shape[1], layer_cache)
