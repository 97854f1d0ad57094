"""The attention kinds of the hybrid, one registry entry each: adding a kind is its module plus one entry.

Each entry holds what the rest of Ling2 needs of a kind:
  spec                               its frozen slice of the config (`ling2.config.specs`);
  module(spec, rngs=...)             the layer: its training forward `(x, positions, segment_ids, *,
                                     layer_index)` and the decoding interface of `ling2.layers.attention.decode`
                                     (init_cache, prefill, step, accept, unpack); `layer_index` is the
                                     global index, traced in a scanned group, for kinds whose constants
                                     depend on it (GLA's decays);
  matmul_params(spec), mixing_flops(spec, seq_len) its FLOP count (`ling2.layers.model`);
  cache                              the type its init_cache returns;
  hf_params(layout)                  its weights' HF names (`ling2.convert.mapping`);
  packed_prefill                     whether its cache can unpack packed prompt rows (`unpack`): generation
                                     offers packed prefill only when every layer's kind can.
"""

from typing import Callable, NamedTuple

from ling2.config import specs
from ling2.layers.attention import gla as attention_gla
from ling2.layers.attention import kda as attention_kda
from ling2.layers.attention import mla as attention_mla


class AttentionKind(NamedTuple):
    spec: type
    module: type
    matmul_params: Callable
    mixing_flops: Callable
    cache: type
    hf_params: Callable
    packed_prefill: bool = True


ATTENTION = {
    "mla": AttentionKind(specs.MLASpec, attention_mla.MLA, attention_mla.matmul_params, attention_mla.mixing_flops,
                         attention_mla.MLACache, attention_mla.hf_params),
    "gla": AttentionKind(specs.GLASpec, attention_gla.GatedLinearAttention, attention_gla.matmul_params,
                         attention_gla.mixing_flops, attention_gla.GLACache, attention_gla.hf_params),
    "kda": AttentionKind(specs.KDASpec, attention_kda.KimiDeltaAttention, attention_kda.matmul_params,
                         attention_kda.mixing_flops, attention_kda.KDACache, attention_kda.hf_params,
                         packed_prefill=False),
}
