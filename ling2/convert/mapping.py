"""Which HF tensor fills which part of the Ling2 model state, for both layouts.

An `Entry` ties one HF tensor to a slice of one leaf of the pure-dict state of
`Ling2Model` (`nnx.to_pure_dict(nnx.state(model))`): the leaf at `path`, indexed by
`index` (the scan group for scanned layers, then the expert for stacked experts).
HF Linear weights are [out, in]; Ling2 kernels are [in..., out...] with the first `nin`
dims the input, so `to_ling2` is `w.T.reshape(...)`; `nin == 0` copies (norms, the
embedding, the expert bias), reshaped when `reshape` names an HF layout of other dims (KDA's
dt_bias [H*D] and short-conv taps [H*D, 1, K]). Where each layer lives is the layer plan's
(`ling2.layers.plan`); HF layer i is plan layer i, MTP depth d is HF layer num_hidden_layers + d.
"""

import math
from typing import NamedTuple

import numpy as np

from ling2.layers.attention.registry import ATTENTION
from ling2.layers.spec import ModelSpec


class Entry(NamedTuple):
    hf: str  # HF tensor name written by ling2_to_hf
    path: tuple  # key path of the leaf in the pure state dict
    index: tuple  # leading indices into the leaf (scan group, expert)
    nin: int  # 0: copy; n > 0: HF [out, in] transposed, the leaf's first n dims (after index) are `in`
    aliases: tuple = ()  # other HF names accepted when reading
    mtp: bool = False  # part of an MTP layer (may be missing with allow_missing_mtp)
    reshape: str = ""  # nin 0 only: "flat" (HF [prod]), "conv" (leaf [..., K] as HF [prod(...), 1, K])


def _reshaped(e: Entry, s: tuple) -> tuple:
    if e.reshape == "flat":
        return (math.prod(s),)
    if e.reshape == "conv":
        return (math.prod(s[:-1]), 1, s[-1])
    return s


def hf_shape(e: Entry, leaf_shape: tuple) -> tuple:
    """The HF tensor's shape for an entry whose Ling2 leaf has `leaf_shape`."""
    s = tuple(leaf_shape[len(e.index):])
    if e.nin == 0:
        return _reshaped(e, s)
    return (math.prod(s[e.nin:]), math.prod(s[:e.nin]))


def to_ling2(e: Entry, w: np.ndarray, leaf_shape: tuple) -> np.ndarray:
    """The Ling2 block of HF tensor `w`: a view (transposed, dims split), no bytes copied."""
    s = tuple(leaf_shape[len(e.index):])
    return w.reshape(s) if e.nin == 0 else w.T.reshape(s)


def to_hf(e: Entry, x: np.ndarray, leaf_shape: tuple) -> np.ndarray:
    """The HF tensor of Ling2 block `x` (C-contiguous): a transposed view, no bytes copied."""
    s = tuple(leaf_shape[len(e.index):])
    if e.nin == 0:
        return x.reshape(_reshaped(e, s)) if e.reshape else x
    return x.reshape(int(np.prod(s[:e.nin])), -1).T


def _attention(layout: str, attn_type: str) -> list[tuple]:
    """(HF suffix, Ling2 sub-path, nin, aliases[, reshape]) of one attention block: its kind's registry entry."""
    return ATTENTION[attn_type].hf_params(layout)


def _mlp(layout: str, mlp_type: str, num_experts: int) -> list[tuple]:
    """(HF suffix, Ling2 sub-path, nin, aliases, expert or None) of one MLP block."""
    proj = ("gate_proj", "up_proj", "down_proj")
    if mlp_type == "dense":
        return [(f"mlp.{p}.weight", ("mlp", p), 1, (), None) for p in proj]
    bias = ["mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"]
    if layout == "deepseek_v3":
        bias.reverse()
    out = [("mlp.gate.weight", ("mlp", "gate", "kernel"), 1, (), None),
           (bias[0], ("mlp", "gate", "expert_bias"), 0, (bias[1],), None)]
    out += [(f"mlp.shared_experts.{p}.weight", ("mlp", "shared_experts", p), 1, (), None) for p in proj]
    out += [(f"mlp.experts.{e}.{p}.weight", ("mlp", "experts", p), 1, (), e) for e in range(num_experts) for p in proj]
    return out


def _block(layout, attn_type, mlp_type, cfg, hf_prefix, path, index, mtp) -> list[Entry]:
    out = [Entry(hf_prefix + "input_layernorm.weight", path + ("input_norm", "weight"), index, 0, mtp=mtp),
           Entry(hf_prefix + "post_attention_layernorm.weight", path + ("post_attention_norm", "weight"), index, 0,
                 mtp=mtp)]
    out += [Entry(hf_prefix + s, path + sub, index, nin, tuple(hf_prefix + a for a in al), mtp, *rest)
            for s, sub, nin, al, *rest in _attention(layout, attn_type)]
    for s, sub, nin, al, e in _mlp(layout, mlp_type, cfg.num_experts):
        idx = index + ((e,) if e is not None else ())
        out.append(Entry(hf_prefix + s, path + sub, idx, nin, tuple(hf_prefix + a for a in al), mtp))
    return out


def entries(cfg, layout: str, leaves: dict) -> list[Entry]:
    """Every Entry for `cfg` whose Ling2 leaf exists in `leaves` ({path: shape}), in HF order.

    Raises ValueError when some leaf of the model has no entry (a mapping bug, not bad input).
    """
    bailing = layout != "deepseek_v3"
    emb = "model.word_embeddings.weight" if bailing else "model.embed_tokens.weight"
    al = ("model.embed_tokens.weight",) if bailing else ("model.word_embeddings.weight",)
    out = [Entry(emb, ("decoder", "embed", "embedding"), (), 0, al)]
    plan = ModelSpec.of(cfg).plan
    for s in plan.layers:
        out += _block(layout, s.attn, s.mlp, cfg, f"model.layers.{s.index}.", s.path, s.stack, False)
    for s in plan.mtp:
        pre, path = f"model.layers.{s.index}.", s.path[:-1]
        final = "final_layernorm.weight" if bailing else "shared_head.norm.weight"
        out += [Entry(pre + "enorm.weight", path + ("enorm", "weight"), (), 0, mtp=True),
                Entry(pre + "hnorm.weight", path + ("hnorm", "weight"), (), 0, mtp=True),
                Entry(pre + "eh_proj.weight", path + ("eh_proj",), (), 1, mtp=True),
                Entry(pre + final, path + ("final_norm", "weight"), (), 0, mtp=True)]
        out += _block(layout, s.attn, s.mlp, cfg, pre, s.path, s.stack, True)
    out += [Entry("model.norm.weight", ("decoder", "final_norm", "weight"), (), 0),
            Entry("lm_head.weight", ("decoder", "lm_head", "kernel"), (), 1)]
    out = [e for e in out if e.path in leaves]
    missing = set(leaves) - {e.path for e in out}
    if missing:
        raise ValueError(f"convert mapping: no HF tensor for Ling2 leaves {sorted('/'.join(map(str, m)) for m in missing)}")
    return out


def ignorable(name: str, layout: str, cfg) -> bool:
    """HF tensors that carry no information for Ling2 (duplicates of shared weights, rope buffers)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if layout == "deepseek_v3" and name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return i >= cfg.base_num_decoder_layers and name.split(".", 3)[3] in ("embed_tokens.weight", "shared_head.head.weight")
    return False
