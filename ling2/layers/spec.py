"""The model a Config describes, derived once: `ModelSpec.of(cfg, mesh)`.

The flat Config (~140 fields) is read here and nowhere below: the model, the decoder, MTP and the FLOP
counts take a `ModelSpec`, and each module takes its own frozen slice of it (`ling2.config.specs`):

  plan     every decoder and MTP layer: index, attention and MLP kind, place in the state (`ling2.layers.plan`);
  layers   what a decoder layer's modules take: `LayerSpecs` (weights, each attention kind's spec, MoE, dense MLP);
  embed    the embedding and output head;
  run      how this run computes it (`RunSpec`: kernels, remat, scan, loss blocks, FP8, mesh axes and rules),
           equal to the `run` every module spec carries.

Specs are frozen and hashable, so modules keep them as static fields and `abstract_model` caches by them.
"""

import dataclasses
from typing import NamedTuple

from ling2.config.specs import EmbedSpec, MoESpec, PlanSpec, RunSpec, WeightsSpec
from ling2.layers.attention.registry import ATTENTION
from ling2.layers.plan import LayerPlan, layer_plan


class LayerSpecs(NamedTuple):
    """What a decoder layer's modules take, for the decoder's layers and MTP's alike."""
    weights: WeightsSpec
    attention: tuple  # ((attention kind, its spec), ...) for every registered kind
    moe: MoESpec
    mlp_dim: int  # width of the dense MLP

    def attention_spec(self, kind: str):
        """The spec of attention `kind`; ValueError naming the known kinds for another."""
        for name, spec in self.attention:
            if name == kind:
                return spec
        raise ValueError(f"unknown attention type {kind!r} (known: {sorted(n for n, _ in self.attention)})")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Ling2 model and how this run computes it (see the module doc)."""
    plan: LayerPlan
    layers: LayerSpecs
    embed: EmbedSpec
    run: RunSpec
    tied: bool  # lm_head is the embedding (logits_via_embedding)
    logits_dtype: str  # the output head's matmul dtype: float32 with float32_logits, else dtype
    mtp_hidden_pre_norm: bool  # MTP consumes the hidden states before the final norm

    @property
    def emb_dim(self) -> int:
        return self.embed.emb_dim

    @property
    def vocab_size(self) -> int:
        return self.embed.vocab_size

    @property
    def dtype(self) -> str:
        return self.embed.dtype

    @classmethod
    def of(cls, cfg, mesh=None) -> "ModelSpec":
        """The spec of `cfg` (a Config) run on `mesh` (a jax Mesh; None: one device)."""
        run = RunSpec.of(cfg, mesh)
        of = lambda spec_type: spec_type.of(cfg, mesh)  # noqa: E731
        layers = LayerSpecs(of(WeightsSpec), tuple((k, of(e.spec)) for k, e in ATTENTION.items()), of(MoESpec),
                            cfg.base_mlp_dim)
        return cls(plan=layer_plan(PlanSpec.of(cfg), scan=run.scan_layers), layers=layers, embed=of(EmbedSpec),
                   run=run, tied=cfg.logits_via_embedding,
                   logits_dtype="float32" if cfg.float32_logits else cfg.dtype,
                   mtp_hidden_pre_norm=cfg.mtp_hidden_pre_norm)
