"""config.json <-> Ling2 config: HF -> Ling2 -> HF keeps every field the official BailingMoeV2_5Config reads.

Reference: the official class's arguments and defaults, written out here from Ring-V2.5
`models/configuration_bailing_moe_v2_5.py` (independent of `hf_config.BAILING_DEFAULTS`), and what the
class stores for a config.json (`official_view`).
"""

import json

import numpy as np
import pytest

from ling2.checkpoint import state as ckpt_state
from ling2.checkpoint.safetensors_io import ShardedReader
from ling2.config import load_config
from ling2.convert import hf_config, hf_to_ling2, ling2_to_hf
from ling2.convert.testing.hf_fixtures import write_random_hf

OFFICIAL = {
    "vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "use_qkv_bias": False,
    "use_bias": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "embedding_dropout": 0.0,
    "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 32768,
    "rope_theta": 600000.0, "use_cache": True, "max_window_layers": 20, "rope_scaling": None, "pad_token_id": 156892,
    "eos_token_id": 156892, "num_experts": 256, "num_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "moe_intermediate_size": 512, "first_k_dense_replace": 1, "head_dim": 128,
    "output_router_logits": False, "use_qk_norm": True, "num_nextn_predict_layers": 0, "mtp_loss_scaling_factor": 0,
    "moe_router_enable_expert_bias": True, "routed_scaling_factor": 1.0, "layer_group_size": 5, "group_norm_size": 4,
    "linear_silu": False, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "rope_interleave": True, "partial_rotary_factor": 0.5, "score_function": "sigmoid",
    "scoring_func": "sigmoid", "seq_aux": True, "topk_method": "noaux_tc", "router_dtype": "fp32",
}


def official_view(hf: dict) -> dict:
    """The attributes BailingMoeV2_5Config(**hf) sets from its arguments: the value given, else the default;
    a null head_dim becomes hidden_size // num_attention_heads; qk_head_dim is nope + rope."""
    out = {k: hf.get(k, v) for k, v in OFFICIAL.items()}
    out["head_dim"] = out["head_dim"] or out["hidden_size"] // out["num_attention_heads"]
    out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    return out


def published_style(cfg) -> dict:
    """A config.json for `cfg`'s shapes written the way a published checkpoint might: every official field,
    non-default values for the ones Ling2 does not model, its own spelling of rope_scaling and eos_token_id,
    and fields outside the official list."""
    hf = {k: v for k, v in hf_config.config_to_hf(cfg, "bailing").items() if k != "moe_shared_expert_intermediate_size"}
    hf.update(num_key_value_heads=2, embedding_dropout=0.1, attention_dropout=0.05, output_dropout=0.2,
              use_cache=False, max_window_layers=7, output_router_logits=True, seq_aux=False, router_dtype="bf16",
              topk_method="group_limited", pad_token_id=3, eos_token_id=[5, 6], bos_token_id=4,
              mtp_loss_scaling_factor=0, rope_theta=50000.0, max_position_embeddings=512,
              rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 128},
              transformers_version="4.57.1", torch_dtype="float32")
    hf["auto_map"] = {"AutoConfig": "configuration_bailing_moe_v2_5.BailingMoeV2_5Config",
                      "AutoModelForCausalLM": "modeling_bailing_moe_v2_5.BailingMoeV2_5ForCausalLM"}
    return hf


@pytest.fixture(scope="module")
def tiny():
    return load_config(model_name="ling2-tiny")


def test_every_official_field_survives_hf_to_ling2_to_hf(tiny):
    src = published_style(tiny)
    cfg = hf_config.load_ling2_config(src, "bailing")
    back = json.loads(json.dumps(hf_config.config_to_hf(cfg, "bailing")))
    assert official_view(back) == official_view(src)
    assert {k: back.get(k) for k in src} == src  # the rest of the source's fields too, spelling included
    assert (cfg.pad_id, cfg.eod_id, cfg.base_num_kv_heads, cfg.mtp_loss_scaling_factor) == (3, 5, 2, 0.0)
    assert (cfg.rope_type, cfg.rope_factor, cfg.original_max_position_embeddings) == ("yarn", 4.0, 128)


@pytest.mark.parametrize("drop", [["group_norm_size", "first_k_dense_replace", "n_group", "topk_group",
                                   "rope_theta", "mtp_loss_scaling_factor", "num_key_value_heads", "use_cache"],
                                  ["num_shared_experts", "pad_token_id", "eos_token_id", "partial_rotary_factor"]])
def test_fields_left_out_mean_the_official_defaults(tiny, drop):
    """A field missing from config.json means what it means to the official class, on the way in and out."""
    src = {k: v for k, v in published_style(tiny).items() if k not in drop}
    cfg = hf_config.load_ling2_config(src, "bailing")
    back = hf_config.config_to_hf(cfg, "bailing")
    assert official_view(back) == official_view(src)
    assert not set(drop) & set(back)  # left out again, not written as a value the source never chose
    if "group_norm_size" in drop:
        assert cfg.group_norm_size == 4 and cfg.n_routing_groups == 8 and cfg.first_num_dense_layers == 1
        assert cfg.mtp_loss_scaling_factor == 0 and cfg.rope_max_timescale == 600000.0


def test_explicit_zero_mtp_weight_and_special_ids_map_to_ling2(tiny):
    src = {**hf_config.config_to_hf(tiny, "bailing"), "mtp_loss_scaling_factor": 0, "pad_token_id": 7,
           "eos_token_id": 9}
    cfg = hf_config.load_ling2_config(src, "bailing")
    assert cfg.mtp_loss_scaling_factor == 0.0 and cfg.mtp_num_layers == 1 and (cfg.pad_id, cfg.eod_id) == (7, 9)
    native = hf_config.config_to_hf(load_config(model_name="ling2-tiny", mtp_loss_scaling_factor=0.0, pad_id=-1,
                                                eod_id=11), "bailing")
    assert native["mtp_loss_scaling_factor"] == 0.0 and native["pad_token_id"] is None
    assert native["eos_token_id"] == 11


def test_native_export_is_loadable_by_the_official_code(tiny):
    """A Ling2-native config.json: the official class builds the same model from it (shared expert width,
    every head with its own k/v) and its auto_map names the official modules' classes."""
    hf = hf_config.config_to_hf(tiny, "bailing")
    assert hf["auto_map"] == {"AutoConfig": "configuration_bailing_moe_v2_5.BailingMoeV2_5Config",
                              "AutoModel": "modeling_bailing_moe_v2_5.BailingMoeV2_5Model",
                              "AutoModelForCausalLM": "modeling_bailing_moe_v2_5.BailingMoeV2_5ForCausalLM"}
    view = official_view(hf)
    assert view["num_shared_experts"] * view["moe_intermediate_size"] == tiny.shared_expert_dim == 128
    assert view["num_key_value_heads"] == view["num_attention_heads"] == tiny.base_num_query_heads
    assert set(OFFICIAL) <= set(hf)  # every field written out, none left to a default
    odd = load_config(model_name="ling2-tiny", moe_shared_expert_dim=96)
    with pytest.raises(hf_config.HFConfigError, match="not a multiple of base_moe_mlp_dim"):
        hf_config.config_to_hf(odd, "bailing")


@pytest.mark.parametrize("dtype, want", [("fp32", "float32"), ("bf16", "bfloat16")])
def test_files_round_trip_through_both_clis(tmp_path, tiny, capsys, dtype, want):
    """hf_to_ling2 then ling2_to_hf on disk: the same config.json fields, the remote-code modules carried along,
    --dtype setting the compute dtype as well as the weights'."""
    small = load_config(model_name="ling2-tiny", base_num_decoder_layers=5, mtp_num_layers=0)
    ref = write_random_hf(tmp_path / "hf", small, dtype=np.dtype(want) if want == "float32" else np.float32)
    src = published_style(small)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(src))
    for m in ("configuration_bailing_moe_v2_5.py", "modeling_bailing_moe_v2_5.py"):
        (tmp_path / "hf" / m).write_text(f"# {m}\n")
    assert hf_to_ling2.main(["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "l2"), "--dtype", dtype,
                             "--no_progress"]) == 0
    cfg = ckpt_state.read_config(tmp_path / "l2" / "config.yml")
    assert cfg.dtype == cfg.weight_dtype == want
    assert ling2_to_hf.main(["--ckpt", str(tmp_path / "l2"), "--out", str(tmp_path / "hf2"), "--no_progress"]) == 0
    assert "note:" not in capsys.readouterr().out
    back = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert official_view(back) == official_view(src)
    assert back["torch_dtype"] == want
    assert (tmp_path / "hf2" / "modeling_bailing_moe_v2_5.py").read_text() == "# modeling_bailing_moe_v2_5.py\n"
    out = ShardedReader(tmp_path / "hf2")
    assert sorted(out.names()) == sorted(ref)



def native(layout, **kw):
    """A Ling2 config each layout can write: ling2-tiny (bailing; deepseek_v3 with every layer MLA), ling3-tiny."""
    if layout == "bailing_hybrid":
        return load_config(model_name="ling3-tiny", **kw)
    return load_config(model_name="ling2-tiny", **({"inhomogeneous_layer_cycle_interval": 1}
                                                    if layout == "deepseek_v3" else {}), **kw)


@pytest.mark.parametrize("layout", hf_config.LAYOUTS)
def test_round_trip_keeps_null_fields_and_adds_no_dtype(layout):
    """A source's keys come back exactly, null values included, with no dtype key it did not have; the
    weights' dtype goes under the source's own dtype key, and under torch_dtype only for a cast."""
    src = {k: v for k, v in hf_config.config_to_hf(native(layout), layout).items() if k != "torch_dtype"}
    src.update(bos_token_id=None, sep_token_id=None, some_future_field=None)
    cfg = hf_config.load_ling2_config(src, layout)
    assert json.loads(json.dumps(hf_config.config_to_hf(cfg, layout))) == src
    assert hf_config.config_to_hf(cfg, layout, "bfloat16") == {**src, "torch_dtype": "bfloat16"}
    newer = hf_config.load_ling2_config({**src, "dtype": "bfloat16"}, layout)  # newer transformers' name
    assert hf_config.config_to_hf(newer, layout) == {**src, "dtype": "float32"}  # the weights Ling2 holds
    assert hf_config.config_to_hf(newer, layout, "bfloat16") == {**src, "dtype": "bfloat16"}
    assert hf_config.config_to_hf(native(layout), layout)["torch_dtype"] == "float32"  # no source: always said


def test_cli_round_trip_writes_back_exactly_the_source(tmp_path):
    """hf_to_ling2 then ling2_to_hf: config.json is the source's, key for key (a null bos_token_id, no
    torch_dtype added)."""
    small = load_config(model_name="ling2-tiny", base_num_decoder_layers=5, mtp_num_layers=0)
    write_random_hf(tmp_path / "hf", small)
    src = {k: v for k, v in published_style(small).items() if k != "torch_dtype"}
    src["bos_token_id"] = None
    (tmp_path / "hf" / "config.json").write_text(json.dumps(src))
    assert hf_to_ling2.main(["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "l2"), "--no_progress"]) == 0
    assert ling2_to_hf.main(["--ckpt", str(tmp_path / "l2"), "--out", str(tmp_path / "hf2"), "--no_progress"]) == 0
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == src


@pytest.mark.parametrize("layout,key", [("bailing_hybrid", "moe_renormalize"), ("bailing_hybrid", "norm_topk_prob"),
                                        ("deepseek_v3", "norm_topk_prob")])
def test_unnormalised_routing_maps_both_ways(layout, key):
    """moe_renormalize / norm_topk_prob false (the official Ling 3 and DeepSeek-V3 routers: raw sigmoid weights
    times routed_scaling_factor) is Ling2's sigmoid_renormalize false, and is written back as the source spelt it."""
    src = hf_config.config_to_hf(native(layout), layout)
    src.pop("moe_renormalize", None)
    src[key] = False
    cfg = hf_config.load_ling2_config(src, layout)
    assert cfg.sigmoid_renormalize is False
    assert hf_config.config_to_hf(cfg, layout) == src
    written = hf_config.config_to_hf(native(layout, sigmoid_renormalize=False), layout)
    assert written["moe_renormalize" if layout == "bailing_hybrid" else "norm_topk_prob"] is False
    assert hf_config.load_ling2_config({**src, key: True}, layout).sigmoid_renormalize is True
    with pytest.raises(hf_config.HFConfigError, match=f"{key}.*must be true or false, got 'false'"):
        hf_config.load_ling2_config({**src, key: "false"}, layout)


def test_bailing_layout_renormalises_exactly_when_top_k_exceeds_one(tiny):
    """The official BailingMoeV2_5 gate has no renormalisation flag: it divides by the sum when top-k > 1 and
    keeps the raw score for top-1, whatever a config.json's norm_topk_prob says."""
    hf = hf_config.config_to_hf(tiny, "bailing")
    assert hf_config.load_ling2_config({**hf, "norm_topk_prob": False}, "bailing").sigmoid_renormalize is True
    top1 = hf_config.load_ling2_config({**hf, "num_experts_per_tok": 1}, "bailing")
    assert top1.sigmoid_renormalize is False
    assert hf_config.config_to_hf(top1, "bailing")["num_experts_per_tok"] == 1
    with pytest.raises(hf_config.HFConfigError, match="renormalises sigmoid weights exactly when top-k > 1"):
        hf_config.config_to_hf(load_config(model_name="ling2-tiny", sigmoid_renormalize=False), "bailing")


@pytest.mark.parametrize("model_type,archs", [("llama", ["LlamaForCausalLM"]), ("qwen3_moe", None),
                                              (None, ["MistralForCausalLM"])])
def test_a_config_of_another_architecture_is_refused_unless_a_layout_is_forced(tmp_path, capsys, model_type, archs):
    """config.json naming an architecture none of the layouts is (a Llama, a Qwen): hf_to_ling2 exits 2 naming
    its model_type and architectures instead of reading its fields as BailingMoeV2_5's; --layout bailing
    converts it anyway, and ling2_to_hf writes it back."""
    small = load_config(model_name="ling2-tiny", base_num_decoder_layers=5, mtp_num_layers=0)
    write_random_hf(tmp_path / "hf", small)
    src = {k: v for k, v in published_style(small).items() if k not in ("model_type", "architectures", "auto_map")}
    src.update({k: v for k, v in (("model_type", model_type), ("architectures", archs)) if v is not None})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(src))
    run = lambda *a: hf_to_ling2.main(["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "l2"),  # noqa: E731
                                       "--no_progress", *a])
    assert run() == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: HFConfigError: config.json: model_type {model_type!r} with architectures "
                          f"{archs or []!r} is none of the layouts Ling2 converts") and err.count("\n") == 1, err
    assert not (tmp_path / "l2").exists()
    assert run("--layout", "bailing") == 0
    assert ling2_to_hf.main(["--ckpt", str(tmp_path / "l2"), "--out", str(tmp_path / "hf2"), "--no_progress"]) == 0
    assert sorted(ShardedReader(tmp_path / "hf2").names()) == sorted(ShardedReader(tmp_path / "hf").names())


@pytest.mark.parametrize("fields,message", [
    ({"architectures": "BailingMoeV2_5ForCausalLM"}, "architectures must be a list of class names, got 'Bailing"),
    ({"architectures": 5}, "architectures must be a list of class names, got 5"),
    ({"architectures": [None]}, r"architectures must be a list of class names, got \[None\]"),
    ({"model_type": 5}, "model_type must be a string, got 5"),
])
def test_architectures_and_model_type_of_the_wrong_type_are_named(fields, message):
    """A config.json's architectures that are not a list of strings (a bare string was read letter by letter, a
    number was a TypeError) or a model_type that is not a string: an HFConfigError naming the field."""
    with pytest.raises(hf_config.HFConfigError, match=f"^config.json: {message}"):
        hf_config.detect_layout({"model_type": "bailing_moe_v2_5", "architectures": ["BailingMoeV2_5ForCausalLM"],
                                 **fields})
