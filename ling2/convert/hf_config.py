"""HF `config.json` <-> Ling2 config, for the three source layouts.

- "bailing": BailingMoeV2_5 (hybrid GLA/MLA, `layer_group_size`, MTP as extra layers). A field
  missing from config.json takes the default of the official `BailingMoeV2_5Config`
  (`BAILING_DEFAULTS`), as the official code would.
- "bailing_hybrid": Ling 3 (transformers' `bailing_hybrid`, BailingHybridForCausalLM / BailingMoeV3):
  KDA + gated MLA. Read by the saved (alias) names (`num_experts`, `moe_renormalize`, ...) or the
  constructor's; KDA's head dim is `linear_head_dim` (transformers overwrites `head_dim` with the rope
  dim), else `head_dim`. Missing fields take `BailingHybridConfig`'s defaults (`HYBRID_DEFAULTS`).
  Ling 2.6 shares `model_type: bailing_hybrid`, so the layout follows `architectures`.
- "deepseek_v3": DeepSeek-V3 (every layer MLA), read into a Ling2 config with
  `inhomogeneous_layer_cycle_interval=1`, head_dim = qk_rope_head_dim, partial_rotary_factor 1.

`hf_to_overrides` gives the Ling2 fields a HF config fixes; `load_ling2_config` applies them on
top of configs/base.yml and keeps the whole config.json in `hf_source_config`. `config_to_hf` is
the reverse, a dict for config.json: every field the official config class reads, written
explicitly; the source's fields Ling2 does not model come back unchanged, and so does the
source's spelling of a field Ling2 does model (e.g. `rope_scaling` without yarn's defaulted keys,
`eos_token_id` as a list) while it still means the same. So HF -> Ling2 -> HF is the identity: the
source's keys, null values included, and no others; the weights' dtype goes under the source's dtype key
(`torch_dtype`, or `dtype` as newer transformers write it), and under `torch_dtype` in a source that
had none only when the weights were cast.
"""

import functools
import re

from ling2.config import ConfigError, load_config
from ling2.config.kinds import FULL, KINDS

LAYOUTS = ("bailing", "bailing_hybrid", "deepseek_v3")

# transformers 5.23 BailingHybridConfig's defaults (the real Ling 3 model), by constructor name.
HYBRID_DEFAULTS = {
    "vocab_size": 157184, "hidden_size": 2560, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 42, "num_attention_heads": 32, "num_key_value_heads": 32, "num_local_experts": 512,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "first_k_dense_replace": 2, "hidden_act": "silu", "max_position_embeddings": 262144,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "pad_token_id": 156892, "eos_token_id": 156895,
    "tie_word_embeddings": False, "attention_bias": False, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 6e6, "head_dim": 128, "short_conv_kernel_size": 4,
    "layer_group_size": 6, "kda_safe_gate": True, "kda_lower_bound": -5.0, "num_mtp_layers": 1,
    "mtp_loss_scaling_factor": 0.0,
}
# config.json name (transformers' attribute_map) -> constructor name.
HYBRID_ALIASES = {
    "model_max_length": "max_position_embeddings", "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group", "num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts", "num_nextn_predict_layers": "num_mtp_layers",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}
# architectures -> layout, for model_type bailing_hybrid (shared by Ling 2.6 and Ling 3).
HYBRID_ARCHITECTURES = {"BailingHybridForCausalLM": "bailing_hybrid", "BailingMoeV3ForCausalLM": "bailing_hybrid",
                        "BailingMoeV2_5ForCausalLM": "bailing"}

# Every argument of the official BailingMoeV2_5Config.__init__ (Ring-V2.5,
# models/configuration_bailing_moe_v2_5.py) with its default.
BAILING_DEFAULTS = {
    "vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "use_qkv_bias": False,
    "use_bias": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "embedding_dropout": 0.0,
    "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 32768,
    "rope_theta": 600000.0, "use_cache": True, "max_window_layers": 20, "rope_scaling": None,
    "pad_token_id": 156892, "eos_token_id": 156892, "num_experts": 256, "num_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "moe_intermediate_size": 512,
    "first_k_dense_replace": 1, "head_dim": 128, "output_router_logits": False, "use_qk_norm": True,
    "num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": 0, "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 1.0, "layer_group_size": 5, "group_norm_size": 4, "linear_silu": False,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "rope_interleave": True, "partial_rotary_factor": 0.5, "score_function": "sigmoid", "scoring_func": "sigmoid",
    "seq_aux": True, "topk_method": "noaux_tc", "router_dtype": "fp32",
}

BAILING_AUTO_MAP = {"AutoConfig": "configuration_bailing_moe_v2_5.BailingMoeV2_5Config",
                    "AutoModel": "modeling_bailing_moe_v2_5.BailingMoeV2_5Model",
                    "AutoModelForCausalLM": "modeling_bailing_moe_v2_5.BailingMoeV2_5ForCausalLM"}

# Ling2 field -> the config.json field it comes from (for error messages).
HF_NAMES = {
    "vocab_size": "vocab_size", "base_emb_dim": "hidden_size", "base_mlp_dim": "intermediate_size",
    "base_num_decoder_layers": "num_hidden_layers", "base_num_query_heads": "num_attention_heads",
    "base_num_kv_heads": "num_key_value_heads", "normalization_layer_epsilon": "rms_norm_eps",
    "logits_via_embedding": "tie_word_embeddings", "init_std": "initializer_range",
    "first_num_dense_layers": "first_k_dense_replace", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "mla_interleaved_rope": "rope_interleave", "num_experts_per_tok": "num_experts_per_tok",
    "base_moe_mlp_dim": "moe_intermediate_size", "routed_scaling_factor": "routed_scaling_factor",
    "n_routing_groups": "n_group", "topk_routing_group": "topk_group", "mtp_num_layers": "num_nextn_predict_layers",
    "rope_max_timescale": "rope_theta", "max_position_embeddings": "max_position_embeddings",
    "original_max_position_embeddings": "rope_scaling.original_max_position_embeddings",
    "rope_type": "rope_scaling.rope_type", "rope_factor": "rope_scaling.factor", "head_dim": "head_dim",
    "inhomogeneous_layer_cycle_interval": "layer_group_size", "partial_rotary_factor": "partial_rotary_factor",
    "use_qk_norm": "use_qk_norm", "use_linear_silu": "linear_silu", "group_norm_size": "group_norm_size",
    "num_experts": "num_experts", "routed_score_func": "score_function",
    "routed_bias": "moe_router_enable_expert_bias", "moe_shared_expert_dim": "num_shared_experts",
    "mtp_loss_scaling_factor": "mtp_loss_scaling_factor", "pad_id": "pad_token_id", "eod_id": "eos_token_id",
    "sigmoid_renormalize": "norm_topk_prob",
}

# The weights' dtype, under the name older (torch_dtype) and newer (dtype) transformers save it.
DTYPE_KEYS = ("torch_dtype", "dtype")
_STRUCTURE = ("architectures", "model_type", "auto_map")


class HFConfigError(ValueError):
    """A HF config Ling2 cannot represent; the message names the field."""


def detect_layout(hf: dict) -> str:
    """The layout of a config.json: by `architectures` where model_type is bailing_hybrid (Ling 2.6 and 3
    share it), else deepseek_v3 or bailing by name."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise HFConfigError(f"config.json: architectures must be a list of class names, got {archs!r}")
    if not isinstance(hf.get("model_type") or "", str):
        raise HFConfigError(f"config.json: model_type must be a string, got {hf.get('model_type')!r}")
    if hf.get("model_type") == "bailing_hybrid" or any(a in HYBRID_ARCHITECTURES for a in archs):
        found = {HYBRID_ARCHITECTURES[a] for a in archs if a in HYBRID_ARCHITECTURES}
        if len(found) != 1:
            raise HFConfigError(f"config.json: architectures {archs!r} with model_type {hf.get('model_type')!r}: "
                                f"cannot tell Ling 2.6 from Ling 3 (known: {sorted(HYBRID_ARCHITECTURES)}); "
                                "pass --layout")
        return found.pop()
    kind = (str(hf.get("model_type") or "") + " ".join(archs)).lower()
    if kind.strip() and "deepseek" not in kind and "bailing" not in kind:
        raise HFConfigError(f"config.json: model_type {hf.get('model_type')!r} with architectures {archs!r} is "
                            "none of the layouts Ling2 converts (bailing: BailingMoeV2_5, bailing_hybrid: Ling 3, "
                            "deepseek_v3); read as one, its fields would mean something else; pass --layout to "
                            "convert it as one anyway")
    return "deepseek_v3" if "deepseek" in kind else "bailing"


def _detected_layout(hf: dict):
    """detect_layout's answer, or None for a config it cannot place (one converted with a forced --layout)."""
    try:
        return detect_layout(hf)
    except HFConfigError:
        return None


def _layout_kind(layout: str) -> str:
    """The linear attention kind an HF layout is written for (`ling2.config.kinds`)."""
    return next(k for k, v in KINDS.items() if v.role == "linear" and v.hf_layout == layout)


def layout_for(cfg) -> str:
    """The HF layout a Ling2 config is written in by default: its linear kind's (`ling2.config.kinds`: bailing_hybrid
    for KDA models, else bailing)."""
    return KINDS[cfg.linear_attention_type].hf_layout


def _hybrid_names(hf: dict, where: str) -> dict:
    """config.json with alias names resolved to constructor names (both given and different: an error)."""
    out = dict(hf)
    for alias, name in HYBRID_ALIASES.items():
        if alias in hf:
            if name in hf and hf[name] != hf[alias]:
                raise HFConfigError(f"{where}: {alias}={hf[alias]!r} and {name}={hf[name]!r} name the same field "
                                    "with different values")
            out[name] = out.pop(alias)
    return out


def _hybrid_overrides(hf: dict, explicit: set, w: str) -> dict:
    """The Ling2 fields of a bailing_hybrid config (hf with constructor names and defaults filled in)."""
    H, L, G = (_pos_int(hf, k, w) for k in ("num_attention_heads", "num_hidden_layers", "layer_group_size"))
    if (hf.get("num_key_value_heads") or H) != H:
        raise HFConfigError(f"{w}: num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads={H}")
    renormalize = _flag(hf, "norm_topk_prob", f"{w}: moe_renormalize (norm_topk_prob)")
    if hf.get("linear_num_heads") not in (None, H):
        raise HFConfigError(f"{w}: linear_num_heads={hf['linear_num_heads']} must equal num_attention_heads={H}")
    rule = ["full_attention" if (i + 1) % G == 0 else "linear_attention" for i in range(L)]
    if hf.get("layer_types") is not None and list(hf["layer_types"]) != rule:
        raise HFConfigError(f"{w}: layer_types {hf['layer_types']!r} differ from the layer_group_size={G} rule "
                            f"{rule!r}; only the rule is supported")
    dense = hf["first_k_dense_replace"]
    mlp_rule = ["dense" if i < dense else "sparse" for i in range(L)]
    if hf.get("mlp_layer_types") is not None and list(hf["mlp_layer_types"]) != mlp_rule:
        raise HFConfigError(f"{w}: mlp_layer_types {hf['mlp_layer_types']!r} differ from the first_k_dense_replace="
                            f"{dense} rule; only the rule is supported")
    head_dim = hf["linear_head_dim"] if hf.get("linear_head_dim") else hf["head_dim"]
    n_shared = hf.get("n_shared_experts") or 0
    return {
        "linear_attention_type": _layout_kind("bailing_hybrid"), "mla_output_gate": True,
        "head_dim": _pos_int({"head_dim": head_dim}, "head_dim", w),
        "inhomogeneous_layer_cycle_interval": G, "q_lora_rank": 0, "mla_interleaved_rope": True,
        "use_qk_norm": False, "group_norm_size": 1, "num_experts": hf["num_local_experts"],
        "routed_score_func": "sigmoid", "routed_bias": True, "norm_topk_prob": True,
        "sigmoid_renormalize": renormalize,
        "shared_experts": 1 if n_shared else 0, "moe_shared_expert_dim": n_shared * hf["moe_intermediate_size"],
        "kda_conv_kernel_size": _pos_int(hf, "short_conv_kernel_size", w), "kda_safe_gate": hf["kda_safe_gate"],
        "kda_lower_bound": hf["kda_lower_bound"], "mtp_num_layers": hf.get("num_mtp_layers") or 0,
        "mtp_loss_scaling_factor": hf["mtp_loss_scaling_factor"],
    }


def _hybrid_rope(hf: dict) -> dict:
    """rope_parameters (transformers 5) as the rope_scaling block `_rope` reads."""
    rp = hf.get("rope_parameters") or {}
    out = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    out["rope_theta"] = rp.get("rope_theta", hf.get("rope_theta", HYBRID_DEFAULTS["rope_theta"]))
    if rp.get("rope_type", "default") != "default":
        out["rope_scaling"] = rp
    return out


def _flag(hf: dict, key: str, where: str) -> bool:
    """hf[key] when it is a JSON boolean (a string such as "false" would read as true), else HFConfigError."""
    v = hf[key]
    if not isinstance(v, bool):
        raise HFConfigError(f"{where} must be true or false, got {v!r}")
    return v


def _need(hf: dict, key: str, where: str):
    if key not in hf:
        raise HFConfigError(f"{where}: missing field {key!r}")
    return hf[key]


def _pos_int(hf: dict, key: str, where: str, none_ok: bool = False):
    """hf[key] when it is a positive int (a value the converter computes with), else HFConfigError."""
    v = _need(hf, key, where)
    if v is None and none_ok:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise HFConfigError(f"{where}: {key} must be a positive integer, got {v!r}")
    return v


def _rope(hf: dict, where: str) -> dict:
    rs = hf.get("rope_scaling")
    max_pos = _pos_int(hf, "max_position_embeddings", where)
    out = {"rope_max_timescale": hf.get("rope_theta", 10000.0), "max_position_embeddings": max_pos,
           "original_max_position_embeddings": max_pos}
    if not rs:
        return {**out, "rope_type": "default", "rope_factor": 1.0}
    if not isinstance(rs, dict):
        raise HFConfigError(f"{where}: rope_scaling must be a mapping or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in ("yarn", "default"):
        raise HFConfigError(f"{where}: rope_scaling.rope_type {kind!r} is not supported (default, yarn)")
    out.update(rope_type=kind, rope_factor=rs.get("factor", 1.0))
    for k in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if rs.get(k) is not None:
            out[k] = rs[k]
    return out


def _special_ids(hf: dict, explicit: set) -> dict:
    """pad_id / eod_id from pad_token_id / eos_token_id (a list: its first id; null pad: -1). A
    defaulted id outside the vocabulary (the official defaults under a small vocabulary) leaves
    Ling2's default."""
    out, vocab = {}, hf.get("vocab_size")
    for hk, lk in (("pad_token_id", "pad_id"), ("eos_token_id", "eod_id")):
        v = hf.get(hk)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is None:
            if lk == "pad_id":
                out[lk] = -1
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise HFConfigError(f"config.json: {hk} must be an integer, a list of integers or null, got {v!r}")
        if hk not in explicit and isinstance(vocab, int) and not 0 <= v < vocab:
            continue
        out[lk] = v
    return out


def hf_to_overrides(hf: dict, layout: str) -> dict:
    """The Ling2 config fields set by a HF config.json dict."""
    w = f"config.json ({layout})"
    if not isinstance(hf, dict):
        raise HFConfigError(f"{w}: top level must be a mapping, got {type(hf).__name__}")
    explicit = set(hf)
    if layout == "bailing":
        hf = {**BAILING_DEFAULTS, **hf}
    elif layout == "bailing_hybrid":
        hf = _hybrid_rope({**HYBRID_DEFAULTS, **_hybrid_names(hf, w)})
        hf["num_nextn_predict_layers"] = hf["num_mtp_layers"]
        hf.pop("q_lora_rank", None)  # the reference ignores it (no q-LoRA in this generation)
        explicit = {HYBRID_ALIASES.get(k, k) for k in explicit}
        # the class's default special ids are no choice of this checkpoint's (a tiny vocabulary drops them)
        explicit -= {k for k in ("pad_token_id", "eos_token_id") if hf.get(k) == HYBRID_DEFAULTS[k]}
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{w}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("use_qkv_bias") or hf.get("use_bias") or hf.get("attention_bias"):
        raise HFConfigError(f"{w}: attention biases (use_qkv_bias/use_bias/attention_bias) are not supported")
    H = _pos_int(hf, "num_attention_heads", w)
    E = _pos_int(hf, "hidden_size", w)
    I_moe = _pos_int(hf, "moe_intermediate_size", w)
    kv = hf.get("num_key_value_heads") or H
    if "num_key_value_heads" not in explicit and isinstance(kv, int) and kv > 0 and H % kv:
        kv = H  # the official default (4) does not divide these heads
    o = {
        "vocab_size": _need(hf, "vocab_size", w), "base_emb_dim": E,
        "base_mlp_dim": _need(hf, "intermediate_size", w), "base_num_decoder_layers": _need(hf, "num_hidden_layers", w),
        "base_num_query_heads": H, "base_num_kv_heads": kv,
        "normalization_layer_epsilon": hf.get("rms_norm_eps", 1e-6),
        "logits_via_embedding": hf.get("tie_word_embeddings", False),
        "init_std": hf.get("initializer_range", 0.02),
        "first_num_dense_layers": hf.get("first_k_dense_replace", 0),
        "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": _need(hf, "kv_lora_rank", w),
        "qk_nope_head_dim": _need(hf, "qk_nope_head_dim", w), "qk_rope_head_dim": _need(hf, "qk_rope_head_dim", w),
        "v_head_dim": _need(hf, "v_head_dim", w), "mla_interleaved_rope": hf.get("rope_interleave", True),
        "num_experts_per_tok": _need(hf, "num_experts_per_tok", w), "base_moe_mlp_dim": I_moe,
        "routed_scaling_factor": hf.get("routed_scaling_factor", 1.0),
        "n_routing_groups": hf.get("n_group") or 1, "topk_routing_group": hf.get("topk_group") or 1,
        "mtp_num_layers": hf.get("num_nextn_predict_layers", 0) or 0, **_rope(hf, w),
        **_special_ids(hf, explicit),
        "routed_bias_dtype": "float32",  # loss-free bias updates (~1e-3) vanish in bf16; the reference keeps fp32
    }
    if layout == "bailing":
        n_shared = _pos_int(hf, "num_shared_experts", w, none_ok=True) if hf.get("num_shared_experts") else 0
        shared = hf.get("moe_shared_expert_intermediate_size") or n_shared * I_moe
        head_dim = _pos_int(hf, "head_dim", w) if hf.get("head_dim") else E // H
        o.update(
            head_dim=head_dim, inhomogeneous_layer_cycle_interval=hf["layer_group_size"],
            partial_rotary_factor=hf["partial_rotary_factor"], use_qk_norm=hf["use_qk_norm"],
            use_linear_silu=hf["linear_silu"], group_norm_size=hf["group_norm_size"],
            num_experts=hf["num_experts"],
            routed_score_func=hf["score_function" if "score_function" in explicit else "scoring_func"],
            routed_bias=hf["moe_router_enable_expert_bias"], shared_experts=1 if shared else 0,
            moe_shared_expert_dim=shared, mtp_loss_scaling_factor=hf["mtp_loss_scaling_factor"],
            sigmoid_renormalize=o["num_experts_per_tok"] != 1,  # the official V2.5 gate renormalises when top-k > 1
        )
    elif layout == "bailing_hybrid":
        o.update(_hybrid_overrides(hf, explicit, w))
    elif layout == "deepseek_v3":
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise HFConfigError(f"{w}: only scoring_func sigmoid with topk_method noaux_tc is supported")
        n_shared = hf.get("n_shared_experts") or 0
        o.update(
            head_dim=hf["qk_rope_head_dim"], inhomogeneous_layer_cycle_interval=1, partial_rotary_factor=1.0,
            use_qk_norm=False, group_norm_size=1, num_experts=_need(hf, "n_routed_experts", w),
            routed_score_func="sigmoid", routed_bias=True, norm_topk_prob=True,
            sigmoid_renormalize=_flag({"norm_topk_prob": True, **hf}, "norm_topk_prob", f"{w}: norm_topk_prob"),
            shared_experts=1 if n_shared else 0, moe_shared_expert_dim=n_shared * I_moe,
        )
    else:
        raise HFConfigError(f"layout: unknown {layout!r} (known: {LAYOUTS})")
    if o["rope_type"] == "default" and o["max_position_embeddings"] < _base_fields()["max_target_length"]:
        o["max_target_length"] = o["max_position_embeddings"]  # base.yml's training length would not fit
    return o


def load_ling2_config(hf: dict, layout: str, *overrides, **kwargs):
    """A full Ling2 Config: base.yml, then the HF fields (and `hf_source_config` = `hf` less its
    quantization_config: Ling2 holds the weights an FP8 checkpoint stands for, and exports them unquantized),
    then `overrides` (key=value or dicts). A value Ling2 rejects is reported with its config.json name."""
    source = {k: v for k, v in hf.items() if k != "quantization_config"}
    try:
        return load_config(hf_to_overrides(hf, layout), {"hf_source_config": source}, *overrides, **kwargs)
    except ConfigError as e:
        def name(m):  # "field (from override):" or "field:" at a line start -> the config.json name too
            hk = HF_NAMES.get(m.group(2))
            return f"{m.group(1)}{hk} (Ling2 {m.group(2)}):" if hk else m.group(0)
        msg = re.sub(r"(?m)^(\s*)(\w+)(?: \(from override\))?:", name, str(e))
        raise HFConfigError(f"config.json ({layout}) does not make a valid Ling2 config: {msg}") from None


def _rope_scaling(cfg):
    if cfg.rope_type == "default":
        return None
    return {"rope_type": cfg.rope_type, "type": cfg.rope_type, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.original_max_position_embeddings, "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow, "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}


TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


def _generated(cfg, layout: str) -> dict:
    shared_width = cfg.shared_experts * cfg.shared_expert_dim
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.base_emb_dim, "intermediate_size": cfg.base_mlp_dim,
        "num_hidden_layers": cfg.base_num_decoder_layers, "num_attention_heads": cfg.base_num_query_heads,
        "num_key_value_heads": cfg.base_num_kv_heads, "hidden_act": "silu",
        "rms_norm_eps": cfg.normalization_layer_epsilon, "tie_word_embeddings": cfg.logits_via_embedding,
        "initializer_range": cfg.init_std, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_max_timescale, "rope_scaling": _rope_scaling(cfg),
        "first_k_dense_replace": cfg.first_num_dense_layers, "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.mla_interleaved_rope, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.base_moe_mlp_dim, "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_routing_groups, "topk_group": cfg.topk_routing_group,
        "num_nextn_predict_layers": cfg.mtp_num_layers,
        "pad_token_id": cfg.pad_id if cfg.pad_id >= 0 else None, "eos_token_id": cfg.eod_id,
    }
    if layout == "bailing":
        if cfg.routed_score_func == "sigmoid" and cfg.sigmoid_renormalize != (cfg.num_experts_per_tok > 1):
            raise HFConfigError(f"layout bailing: sigmoid_renormalize={cfg.sigmoid_renormalize} with "
                                f"num_experts_per_tok={cfg.num_experts_per_tok}: the official BailingMoeV2_5 gate "
                                "has no such setting, it renormalises sigmoid weights exactly when top-k > 1 "
                                "(bailing_hybrid and deepseek_v3 can say either)")
        n_shared = None
        if shared_width:
            if shared_width % cfg.base_moe_mlp_dim:
                raise HFConfigError(f"layout bailing: the shared expert width {shared_width} is not a multiple of "
                                    f"base_moe_mlp_dim={cfg.base_moe_mlp_dim}; the official code builds it as "
                                    "num_shared_experts * moe_intermediate_size")
            n_shared = shared_width // cfg.base_moe_mlp_dim
        return {
            "architectures": ["BailingMoeV2_5ForCausalLM"], "model_type": "bailing_moe_v2_5",
            "auto_map": dict(BAILING_AUTO_MAP), **BAILING_DEFAULTS, **common, "head_dim": cfg.head_dim,
            "layer_group_size": cfg.inhomogeneous_layer_cycle_interval,
            "group_norm_size": cfg.group_norm_size, "linear_silu": cfg.use_linear_silu, "use_qk_norm": cfg.use_qk_norm,
            "partial_rotary_factor": cfg.partial_rotary_factor, "num_experts": cfg.num_experts,
            "num_shared_experts": n_shared, "moe_shared_expert_intermediate_size": shared_width or None,
            "score_function": cfg.routed_score_func, "scoring_func": cfg.routed_score_func,
            "moe_router_enable_expert_bias": cfg.routed_bias, "mtp_loss_scaling_factor": cfg.mtp_loss_scaling_factor,
            "use_qkv_bias": False, "use_bias": False,
        }
    if layout == "bailing_hybrid":
        return _hybrid_generated(cfg, common, shared_width)
    if layout == "deepseek_v3":
        if any(t != FULL for t in cfg.layer_types):
            raise HFConfigError(f"layout deepseek_v3: every layer must be {FULL.upper()} "
                                "(inhomogeneous_layer_cycle_interval=1)")
        if shared_width and shared_width % cfg.base_moe_mlp_dim:
            raise HFConfigError(f"layout deepseek_v3: shared expert width {shared_width} is not a multiple of "
                                f"base_moe_mlp_dim={cfg.base_moe_mlp_dim}")
        if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias:
            raise HFConfigError("layout deepseek_v3: needs routed_score_func sigmoid with routed_bias")
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
                "n_routed_experts": cfg.num_experts, "n_shared_experts": shared_width // cfg.base_moe_mlp_dim,
                "norm_topk_prob": cfg.sigmoid_renormalize, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                "attention_bias": False, "head_dim": cfg.qk_rope_head_dim}
    raise HFConfigError(f"layout: unknown {layout!r} (known: {LAYOUTS})")


def _hybrid_generated(cfg, common: dict, shared_width: int) -> dict:
    """config.json of a Ling 3 config, in the names transformers saves (attribute_map aliases)."""
    w = "layout bailing_hybrid"
    hybrid = [k for k, v in KINDS.items() if v.hf_layout == "bailing_hybrid"]
    if cfg.linear_attention_type not in hybrid or not cfg.mla_output_gate:
        raise HFConfigError(f"{w}: needs linear_attention_type {' or '.join(hybrid)} and mla_output_gate true")
    if cfg.q_lora_rank:
        raise HFConfigError(f"{w}: q_lora_rank={cfg.q_lora_rank}: the reference MLA has no q-LoRA (set 0)")
    if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias or not cfg.mla_interleaved_rope:
        raise HFConfigError(f"{w}: needs routed_score_func sigmoid, routed_bias and mla_interleaved_rope")
    if cfg.base_num_kv_heads != cfg.base_num_query_heads:
        raise HFConfigError(f"{w}: base_num_kv_heads must equal base_num_query_heads")
    if shared_width % cfg.base_moe_mlp_dim:
        raise HFConfigError(f"{w}: the shared expert width {shared_width} is not a multiple of "
                            f"base_moe_mlp_dim={cfg.base_moe_mlp_dim}")
    G, L = cfg.inhomogeneous_layer_cycle_interval, cfg.base_num_decoder_layers
    out = {k: v for k, v in common.items() if k not in ("q_lora_rank", "rope_interleave", "rope_scaling")}
    rs = _rope_scaling(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_max_timescale} if rs is None else {
        **{k: v for k, v in rs.items() if k != "type"}, "rope_theta": cfg.rope_max_timescale}
    for name, alias in (("max_position_embeddings", "model_max_length"), ("n_group", "num_expert_group"),
                        ("num_experts_per_tok", "num_experts_per_token"),
                        ("num_nextn_predict_layers", "num_nextn_predict_layers")):
        out[alias] = out.pop(name)
    out.update({
        "architectures": ["BailingHybridForCausalLM"], "model_type": "bailing_hybrid", "rope_parameters": rope,
        "num_experts": cfg.num_experts, "num_shared_experts": shared_width // cfg.base_moe_mlp_dim,
        "moe_renormalize": cfg.sigmoid_renormalize, "attention_bias": False, "head_dim": cfg.qk_rope_head_dim,
        "linear_head_dim": cfg.head_dim, "linear_num_heads": cfg.base_num_query_heads,
        "qk_head_dim": cfg.qk_head_dim, "short_conv_kernel_size": cfg.kda_conv_kernel_size,
        "linear_conv_kernel_dim": cfg.kda_conv_kernel_size, "layer_group_size": G,
        "kda_safe_gate": cfg.kda_safe_gate, "kda_lower_bound": cfg.kda_lower_bound,
        "layer_types": ["full_attention" if (i + 1) % G == 0 else "linear_attention" for i in range(L)],
        "mlp_layer_types": ["dense" if i < cfg.first_num_dense_layers else "sparse" for i in range(L)],
        "mtp_loss_scaling_factor": cfg.mtp_loss_scaling_factor,
    })
    return out


def config_to_hf(cfg, layout: str, torch_dtype: str = "") -> dict:
    """config.json for a Ling2 config in `layout`: every field the official config class reads.

    With `cfg.hf_source_config` (the config.json it was converted from), the output follows the source:
    its fields Ling2 does not model verbatim, its spelling of those Ling2 does where that still maps to
    `cfg`'s values, and a field it left out stays out where its default means the same.

    `torch_dtype` names the weights' dtype: `cfg.weight_dtype`, or the dtype they are cast to (a
    transformers name, e.g. "bfloat16"). With a source it goes under the source's dtype key(s)
    (DTYPE_KEYS), and where the source had none, only when a cast was asked for."""
    out = _generated(cfg, layout)
    dtype = torch_dtype or cfg.weight_dtype
    src = cfg.hf_source_config
    if not src or _detected_layout(src) != layout:
        return {**out, "torch_dtype": dtype}
    want = _meaning(out, layout)
    for k, v in src.items():
        if k in DTYPE_KEYS or (k in out and out[k] == v):
            continue
        if k not in out:
            out[k] = v
            continue
        try:
            same = _meaning({**out, k: v}, layout) == want
        except HFConfigError:
            same = False
        if same:
            out[k] = v
    for k in [k for k in out if k not in src and k not in _STRUCTURE]:
        rest = {kk: vv for kk, vv in out.items() if kk != k}
        if _meaning(rest, layout) == want:  # the source left it to its default: so do we
            out = rest
    for k in [k for k in DTYPE_KEYS if k in src] or (["torch_dtype"] if torch_dtype else []):
        out[k] = dtype
    return out


def _meaning(hf: dict, layout: str) -> dict:
    """The Ling2 fields a config.json sets, over base.yml's defaults (so a key left to its default and the
    same value written out mean the same)."""
    return {**_base_fields(), **hf_to_overrides(hf, layout)}


@functools.lru_cache(maxsize=1)
def _base_fields() -> dict:
    return load_config().model_dump()
