"""The Ling2 model: the decoder stack plus its MTP depths, the one module the trainer, the
converter and generation build.

  model(ids)                -> DecoderOutput (logits [B,T,V], hidden states, MoE aux); MTP is not run
  model.loss_sums(batch...) -> LossSums: the main next-token CE sums, each MTP depth's sums and
                               every MoE layer's aux, for the trainer to normalise once
  model.expert_biases()     -> every loss-free-balancing bias with the layers of its rows
  update_expert_biases(state, counts, spec) -> the state with every bias moved once (pure; the trainer's)

Everything here takes a `ModelSpec` (`ling2.layers.spec`: `ModelSpec.of(cfg, mesh)`), not the Config.
The decoder is built before MTP, so the decoder's weights do not depend on mtp_num_layers.
State paths ("decoder/...", "mtp/depths/d/...") are the layer plan's (`ling2.layers.plan`).
"""

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ling2.layers.moe import layer as moe
from ling2.layers.attention.registry import ATTENTION
from ling2.layers.decoder import DecoderOutput, Ling2Decoder
from ling2.layers.embed import Embed
from ling2.layers.moe.layer import bias_update
from ling2.layers.moe.router import RoutedBias
from ling2.layers.mtp import MTP, MTPOutput
from ling2.layers.norms import GroupRMSNorm, RMSNorm
from ling2.layers.spec import ModelSpec


class LossSums(NamedTuple):
    ce: jax.Array  # fp32 sum of loss_weight * CE of the next token
    tokens: jax.Array  # fp32 sum of loss weights
    hits: jax.Array  # fp32 loss-weighted count of argmax == target
    mtp: Optional[MTPOutput]  # per-depth sums, None without MTP layers
    moe_aux: dict  # {global layer index: MoEAux}, decoder and MTP layers


class Ling2Model(nnx.Module):
    """Ling2 decoder + MTP. Call with ids [B,T] (optional positions / segment_ids [B,T])."""

    def __init__(self, spec: ModelSpec, *, rngs: nnx.Rngs):
        self.decoder = Ling2Decoder(spec, rngs=rngs)
        self.mtp = MTP(spec, rngs=rngs) if spec.plan.mtp else None
        self.mtp_hidden_pre_norm = spec.mtp_hidden_pre_norm
        self.bias_rows = tuple((layer.path, layer.stack, layer.index) for layer in spec.plan.all()
                               if layer.mlp == "moe")

    def __call__(self, ids_BT, positions_BT=None, segment_ids_BT=None, valid_BT=None) -> DecoderOutput:
        """The main model's forward (no MTP): logits [B,T,V], hidden states and MoE aux."""
        return self.decoder(ids_BT, positions_BT, segment_ids_BT, valid_BT)

    def loss_sums(self, ids_BT, targets_BT, loss_weights_BT, positions_BT, segment_ids_BT,
                  valid_BT=None, main_only: bool = False) -> LossSums:
        """Loss sums of one batch (`main_only`: without MTP); `valid_BT` (default segment_ids != 0) masks MoE
        statistics."""
        if valid_BT is None:
            valid_BT = segment_ids_BT != 0
        d = self.decoder
        out = d(ids_BT, positions_BT, segment_ids_BT, valid_BT, return_logits=False)
        ce, tokens, hits = d.ce_sums(out.hidden, targets_BT, loss_weights_BT)
        moe_aux, mtp = dict(out.moe_aux), None
        if self.mtp is not None and not main_only:
            hidden = out.hidden_pre_norm if self.mtp_hidden_pre_norm else out.hidden
            mtp = self.mtp(d, hidden, ids_BT, targets_BT, loss_weights_BT, positions_BT, segment_ids_BT, valid_BT)
            moe_aux.update(mtp.moe_aux)
        return LossSums(ce, tokens, hits, mtp, moe_aux)

    def expert_biases(self) -> list[tuple[RoutedBias, list[int]]]:
        """Every expert-bias variable with the global layer index of each of its rows: [E] has one
        row, a scanned group's stacked [n, E] has n (in stack order)."""
        found = {}
        for path, stack, index in self.bias_rows:
            module = self
            for key in path:
                module = module[key] if isinstance(key, int) else getattr(module, key)
            bias = getattr(module.mlp.gate, "expert_bias", None)
            if isinstance(bias, RoutedBias):
                found.setdefault(id(bias), (bias, []))[1].append(index)
        return list(found.values())


def expert_bias_rows(spec: ModelSpec) -> dict:
    """{state path of an expert bias: the global layer index of each of its rows}: an [E] bias has one row,
    a scanned group's stacked [n, E] bias n, in stack order."""
    rows = {}
    for layer in spec.plan.all():
        if layer.mlp == "moe":
            rows.setdefault(layer.path + ("mlp", "gate", "expert_bias"), []).append(layer.index)
    return rows


def update_expert_biases(tree, counts: dict, spec: ModelSpec):
    """`tree` (an nnx.State) with each expert bias moved once by loss-free balancing, from the step's
    assignments {layer index: [E]} summed over its micro-batches; every other Variable as it is."""
    rows, router = expert_bias_rows(spec), spec.layers.moe

    def update(path, var):
        layers = rows.get(tuple(k.key for k in path))
        if layers is None:
            return var
        bias = var[...]
        bias_RE = bias.reshape(len(layers), -1)
        new_RE = jnp.stack([bias_update(bias_RE[r], counts[i], router) for r, i in enumerate(layers)])
        return var.replace(new_RE.reshape(bias.shape).astype(bias.dtype))

    return jax.tree_util.tree_map_with_path(update, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.lru_cache(maxsize=8)
def abstract_model(spec: ModelSpec) -> Ling2Model:
    """Ling2Model(spec) with ShapeDtypeStruct leaves (nnx.eval_shape; nothing computed), cached per spec
    (`abstract_model.cache_clear()` empties the cache)."""
    return nnx.eval_shape(lambda: Ling2Model(spec, rngs=nnx.Rngs(0)))


def param_roles(spec: ModelSpec) -> dict:
    """{state path: role} of every Variable of Ling2Model(spec), from the module that owns it:
    'embedding' (the token embedding), 'norm' (an RMSNorm / GroupRMSNorm scale), 'bias' (a loss-free
    expert bias) or 'matrix' (every other weight: projections, experts, router, lm_head, eh_proj).
    A scanned stack holds the same modules, so its Variables get the same roles as unscanned ones."""
    nodes = list(nnx.iter_graph(abstract_model(spec)))
    modules = {path: node for path, node in nodes if isinstance(node, nnx.Module)}
    roles = {}
    for path, node in nodes:
        if isinstance(node, nnx.Variable):
            owner = modules.get(path[:-1])
            if isinstance(node, RoutedBias):
                roles[path] = "bias"
            elif isinstance(owner, (RMSNorm, GroupRMSNorm)):
                roles[path] = "norm"
            elif isinstance(owner, Embed):
                roles[path] = "embedding"
            else:
                roles[path] = "matrix"
    return roles


def count_params(spec: ModelSpec) -> dict:
    """Trainable parameters (nnx.Param; not the selection-only expert bias) of Ling2Model(spec):
    {'embed', 'lm_head', 'final_norm', 'layers', 'mtp', 'decoder', 'total', 'active'}. `active`
    counts `num_experts_per_tok` routed experts per MoE layer instead of all of them."""
    sizes = {path: int(np.prod(v.shape)) for path, v in nnx.to_flat_state(nnx.state(abstract_model(spec), nnx.Param))}
    under = lambda *head: sum(n for p, n in sizes.items() if p[:len(head)] == head)  # noqa: E731
    out = {"embed": under("decoder", "embed"), "lm_head": under("decoder", "lm_head"),
           "final_norm": under("decoder", "final_norm"), "mtp": under("mtp")}
    out["layers"] = sum(under("decoder", part) for part in ("layers", "prefix", "groups", "suffix"))
    out["decoder"] = under("decoder")
    out["total"] = sum(sizes.values())
    m = spec.layers.moe
    inactive = 3 * m.emb_dim * m.base_moe_mlp_dim * (m.num_experts - m.num_experts_per_tok)
    out["active"] = out["total"] - inactive * sum(s.mlp == "moe" for s in spec.plan.all())
    return out


def layer_flops_per_token(spec: ModelSpec, layer, seq_len: int) -> float:
    """Training FLOPs of one token through `layer` (a LayerSpec of spec.plan) at `seq_len`: 3 x (2 x its active
    matmul weights + its attention kind's token mixing, `mixing_flops` beside its module)."""
    attn, attn_spec = ATTENTION[layer.attn], spec.layers.attention_spec(layer.attn)
    E = spec.emb_dim
    weights = attn.matmul_params(attn_spec)
    weights += 3 * E * spec.layers.mlp_dim if layer.mlp == "dense" else moe.matmul_params(spec.layers.moe)
    return 3.0 * (2 * weights + attn.mixing_flops(attn_spec, seq_len))


def training_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward) at `seq_len`: every layer's
    (`layer_flops_per_token`), MTP's eh_proj and each lm_head. The embedding lookup and norms are not counted."""
    E, mtp = spec.emb_dim, len(spec.plan.mtp)
    layers = sum(layer_flops_per_token(spec, layer, seq_len) for layer in spec.plan.all())
    return layers + 3.0 * 2 * (mtp * 2 * E * E + (1 + mtp) * E * spec.vocab_size)
