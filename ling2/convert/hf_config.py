"""HF `config.json` <-> Ling2 config, for the two source layouts.

- "bailing": BailingMoeV2_5 (hybrid GLA/MLA, `layer_group_size`, MTP as extra layers).
- "deepseek_v3": DeepSeek-V3 (every layer MLA), read into a Ling2 config with
  `inhomogeneous_layer_cycle_interval=1`, head_dim = qk_rope_head_dim, partial_rotary_factor 1.

`hf_to_overrides` gives the Ling2 fields a HF config fixes; `load_ling2_config` applies
them on top of configs/base.yml. `config_to_hf` is the reverse, a dict for config.json.
"""

from ling2.config import load_config

LAYOUTS = ("bailing", "deepseek_v3")


class HFConfigError(ValueError):
    """A HF config Ling2 cannot represent; the message names the field."""


def detect_layout(hf: dict) -> str:
    kind = (hf.get("model_type", "") + " ".join(hf.get("architectures") or [])).lower()
    return "deepseek_v3" if "deepseek" in kind else "bailing"


def _need(hf: dict, key: str, where: str):
    if key not in hf:
        raise HFConfigError(f"{where}: missing field {key!r}")
    return hf[key]


def _rope(hf: dict) -> dict:
    rs = hf.get("rope_scaling")
    out = {"rope_max_timescale": float(hf.get("rope_theta", 10000.0)),
           "max_position_embeddings": hf["max_position_embeddings"],
           "original_max_position_embeddings": hf["max_position_embeddings"]}
    if not rs:
        return {**out, "rope_type": "default", "rope_factor": 1.0}
    kind = rs.get("rope_type", rs.get("type"))
    if kind not in ("yarn", "default"):
        raise HFConfigError(f"config.json: rope_scaling.rope_type {kind!r} is not supported (default, yarn)")
    out.update(rope_type=kind, rope_factor=float(rs.get("factor", 1.0)))
    for hk, lk in (("original_max_position_embeddings", "original_max_position_embeddings"), ("beta_fast", "beta_fast"),
                   ("beta_slow", "beta_slow"), ("mscale", "mscale"), ("mscale_all_dim", "mscale_all_dim")):
        if rs.get(hk) is not None:
            out[lk] = rs[hk]
    return out


def hf_to_overrides(hf: dict, layout: str) -> dict:
    """The Ling2 config fields set by a HF config.json dict."""
    w = f"config.json ({layout})"
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{w}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("use_qkv_bias") or hf.get("use_bias") or hf.get("attention_bias"):
        raise HFConfigError(f"{w}: attention biases (use_qkv_bias/use_bias/attention_bias) are not supported")
    H = _need(hf, "num_attention_heads", w)
    o = {
        "decoder_block": "ling2", "vocab_size": _need(hf, "vocab_size", w), "base_emb_dim": _need(hf, "hidden_size", w),
        "base_mlp_dim": _need(hf, "intermediate_size", w), "base_num_decoder_layers": _need(hf, "num_hidden_layers", w),
        "base_num_query_heads": H, "base_num_kv_heads": H,
        "normalization_layer_epsilon": hf.get("rms_norm_eps", 1e-6),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
        "init_std": hf.get("initializer_range", 0.02), "attention_type": "mla",
        "first_num_dense_layers": hf.get("first_k_dense_replace", 0),
        "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": _need(hf, "kv_lora_rank", w),
        "qk_nope_head_dim": _need(hf, "qk_nope_head_dim", w), "qk_rope_head_dim": _need(hf, "qk_rope_head_dim", w),
        "v_head_dim": _need(hf, "v_head_dim", w), "mla_interleaved_rope": bool(hf.get("rope_interleave", True)),
        "num_experts_per_tok": _need(hf, "num_experts_per_tok", w),
        "base_moe_mlp_dim": _need(hf, "moe_intermediate_size", w),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "n_routing_groups": hf.get("n_group") or 1, "topk_routing_group": hf.get("topk_group") or 1,
        "mtp_num_layers": hf.get("num_nextn_predict_layers", 0) or 0, **_rope(hf),
        "routed_bias_dtype": "float32",  # loss-free bias updates (~1e-3) vanish in bf16; the reference keeps fp32
    }
    if layout == "bailing":
        E = _need(hf, "num_experts", w)
        n_shared = hf.get("num_shared_experts") or 0
        score = hf.get("score_function", hf.get("scoring_func", "sigmoid"))
        o.update(
            head_dim=hf.get("head_dim") or hf["hidden_size"] // H,
            inhomogeneous_layer_cycle_interval=_need(hf, "layer_group_size", w),
            partial_rotary_factor=hf.get("partial_rotary_factor", 0.5), use_qk_norm=bool(hf.get("use_qk_norm", True)),
            use_linear_silu=bool(hf.get("linear_silu", False)), group_norm_size=hf.get("group_norm_size", 1),
            num_experts=E, routed_score_func=score, routed_bias=bool(hf.get("moe_router_enable_expert_bias", True)),
            shared_experts=1 if n_shared else 0,
            moe_shared_expert_dim=hf.get("moe_shared_expert_intermediate_size") or n_shared * hf["moe_intermediate_size"],
        )
        if hf.get("mtp_loss_scaling_factor"):
            o["mtp_loss_scaling_factor"] = hf["mtp_loss_scaling_factor"]
    elif layout == "deepseek_v3":
        if not hf.get("norm_topk_prob", True):
            raise HFConfigError(f"{w}: norm_topk_prob false is not supported (Ling2 always normalises sigmoid weights)")
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise HFConfigError(f"{w}: only scoring_func sigmoid with topk_method noaux_tc is supported")
        n_shared = hf.get("n_shared_experts") or 0
        o.update(
            head_dim=hf["qk_rope_head_dim"], inhomogeneous_layer_cycle_interval=1, partial_rotary_factor=1.0,
            use_qk_norm=False, group_norm_size=1, num_experts=_need(hf, "n_routed_experts", w),
            routed_score_func="sigmoid", routed_bias=True, norm_topk_prob=True,
            shared_experts=1 if n_shared else 0, moe_shared_expert_dim=n_shared * hf["moe_intermediate_size"],
        )
    else:
        raise HFConfigError(f"layout: unknown {layout!r} (known: {LAYOUTS})")
    return o


def load_ling2_config(hf: dict, layout: str, *overrides, **kwargs):
    """A full Ling2 Config: base.yml, then the HF fields, then `overrides` (key=value or dicts)."""
    return load_config(hf_to_overrides(hf, layout), *overrides, **kwargs)


def _rope_scaling(cfg):
    if cfg.rope_type == "default":
        return None
    return {"rope_type": cfg.rope_type, "type": cfg.rope_type, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.original_max_position_embeddings, "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow, "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim}


TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


def config_to_hf(cfg, layout: str, torch_dtype: str = "") -> dict:
    """config.json for a Ling2 config in `layout`; loaders (HF, vLLM) read these fields."""
    shared_width = cfg.shared_experts * cfg.shared_expert_dim
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.emb_dim, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_decoder_layers, "num_attention_heads": cfg.num_query_heads,
        "num_key_value_heads": cfg.num_query_heads, "hidden_act": "silu",
        "rms_norm_eps": cfg.normalization_layer_epsilon, "tie_word_embeddings": cfg.logits_via_embedding,
        "initializer_range": cfg.init_std, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_max_timescale, "rope_scaling": _rope_scaling(cfg),
        "first_k_dense_replace": cfg.first_num_dense_layers, "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "rope_interleave": cfg.mla_interleaved_rope, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.base_moe_mlp_dim, "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_group": cfg.n_routing_groups, "topk_group": cfg.topk_routing_group,
        "num_nextn_predict_layers": cfg.mtp_num_layers, "torch_dtype": torch_dtype or cfg.weight_dtype,
    }
    if layout == "bailing":
        n_shared = 0
        if shared_width:
            I = cfg.base_moe_mlp_dim
            n_shared = shared_width // I if shared_width % I == 0 else 1
        return {
            "architectures": ["BailingMoeV2_5ForCausalLM"], "model_type": "bailing_moe_v2_5",
            "auto_map": {"AutoConfig": "configuration_bailing_moe_v2_5.BailingMoeV2_5Config",
                         "AutoModelForCausalLM": "modeling_bailing_moe_v2_5.BailingMoeV2_5ForCausalLM"},
            **common, "head_dim": cfg.head_dim, "layer_group_size": cfg.inhomogeneous_layer_cycle_interval,
            "group_norm_size": cfg.group_norm_size, "linear_silu": cfg.use_linear_silu, "use_qk_norm": cfg.use_qk_norm,
            "partial_rotary_factor": cfg.partial_rotary_factor, "num_experts": cfg.num_experts,
            "num_shared_experts": n_shared or None, "moe_shared_expert_intermediate_size": shared_width or None,
            "score_function": cfg.routed_score_func, "scoring_func": cfg.routed_score_func,
            "moe_router_enable_expert_bias": cfg.routed_bias, "mtp_loss_scaling_factor": cfg.mtp_loss_scaling_factor,
            "use_qkv_bias": False, "use_bias": False,
        }
    if layout == "deepseek_v3":
        if any(t != "mla" for t in cfg.layer_types):
            raise HFConfigError("layout deepseek_v3: every layer must be MLA (inhomogeneous_layer_cycle_interval=1)")
        if shared_width and shared_width % cfg.base_moe_mlp_dim:
            raise HFConfigError(f"layout deepseek_v3: shared expert width {shared_width} is not a multiple of "
                                f"base_moe_mlp_dim={cfg.base_moe_mlp_dim}")
        if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias:
            raise HFConfigError("layout deepseek_v3: needs routed_score_func sigmoid with routed_bias")
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
                "n_routed_experts": cfg.num_experts, "n_shared_experts": shared_width // cfg.base_moe_mlp_dim,
                "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                "attention_bias": False, "head_dim": cfg.qk_rope_head_dim}
    raise HFConfigError(f"layout: unknown {layout!r} (known: {LAYOUTS})")
