"""Token embedding [V, E] and the output head [E, V] (untied in Ling2; `attend` ties them).

HF names: model.word_embeddings.weight [V, E] (same layout as `embedding`) and
lm_head.weight [V, E] (the transpose of `LMHead.kernel`).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ling2.config.specs import EmbedSpec
from ling2.layers.sharding import constrain


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def logits_einsum(spec: str, x, w, out_dtype):
    """einsum(spec, x, w) with an `out_dtype` result (fp32 logits from bf16 operands), whose backward rounds the
    logits' cotangent to the operands' dtype before both GEMMs (fp32 accumulation, as Megatron-LM and MaxText
    run them): an fp32 cotangent would make the two [tokens, vocab] GEMMs of every head fp32 ones, about
    twice the time of the whole forward head on a GPU. With fp32 operands it is plain autodiff."""
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _logits_einsum_fwd(spec, x, w, out_dtype):
    return logits_einsum(spec, x, w, out_dtype), (x, w)


def _logits_einsum_bwd(spec, out_dtype, res, dz):
    x, w = res
    _, vjp = jax.vjp(functools.partial(jnp.einsum, spec), x, w)
    return vjp(dz.astype(x.dtype))


logits_einsum.defvjp(_logits_einsum_fwd, _logits_einsum_bwd)


class Embed(nnx.Module):
    """Looks up token ids [B, T] -> [B, T, E] in the compute dtype."""

    def __init__(self, spec: EmbedSpec, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(spec.init_std)
        self.embedding = nnx.Param(init(rngs.params(), (spec.vocab_size, spec.emb_dim), jnp.dtype(spec.weight_dtype)),
                                   out_sharding=("vocab", "embed"), eager_sharding=False)
        self.dtype, self.run = spec.dtype, spec.run

    def __call__(self, ids_BT):
        x_BTE = jnp.take(self.embedding[...], ids_BT, axis=0).astype(jnp.dtype(self.dtype))
        return constrain(x_BTE, ("activation_batch", "activation_length", "activation_embed"), self.run)

    def attend(self, x_BTE, out_dtype):
        """Tied output logits x @ embedding^T [B, T, V]."""
        w = self.embedding[...].astype(jnp.dtype(self.dtype))
        return logits_einsum("bte,ve->btv", x_BTE.astype(w.dtype), w, jnp.dtype(out_dtype))


class LMHead(nnx.Module):
    """Untied output projection [B, T, E] -> logits [B, T, V], fp32 with float32_logits."""

    def __init__(self, spec: EmbedSpec, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(spec.init_std)
        self.kernel = nnx.Param(init(rngs.params(), (spec.emb_dim, spec.vocab_size), jnp.dtype(spec.weight_dtype)),
                                out_sharding=("embed", "vocab"), eager_sharding=False)
        self.dtype, self.run = spec.dtype, spec.run
        self.out_dtype = "float32" if spec.float32_logits else spec.dtype

    def __call__(self, x_BTE):
        w = self.kernel[...].astype(jnp.dtype(self.dtype))
        logits = logits_einsum("bte,ev->btv", x_BTE.astype(w.dtype), w, jnp.dtype(self.out_dtype))
        return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"), self.run)
