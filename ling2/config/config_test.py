"""Config loading, derived values and bad-input errors.

The expected values are the RFC "PR1 - Ling2 config extension" checks and the
layer-type rule of the HF reference (BailingMoeV2_5), computed by hand.
"""

import re

import pytest

from ling2.config import Config, ConfigError, load_config
from ling2.config.loader import BASE_CONFIG, CONFIGS_DIR


def test_rfc_ling2_values():
    cfg = load_config(model_name="ling2")
    assert cfg.inhomogeneous_layer_cycle_interval == 5
    assert cfg.first_num_dense_layers == 1
    assert cfg.moe_shared_expert_dim == 2048
    assert cfg.shared_expert_dim == 2048


def test_rfc_base_defaults():
    cfg = load_config()
    assert cfg.model_name == "default"
    assert cfg.moe_z_loss_weight == 0.0
    assert cfg.calculate_per_token_loss is True
    assert cfg.moe_shared_expert_dim == 0
    # Shared expert width falls back to the routed expert width.
    assert cfg.shared_expert_dim == cfg.base_moe_mlp_dim


def test_rfc_new_field_defaults():
    cfg = load_config()
    expected = dict(moe_z_loss_weight=0.0, moe_shared_expert_dim=0, routed_bias_dtype="", enable_routed_bias_grad=True,
                    routed_bias_zero_mean_update=False, mla_interleaved_rope=True, group_norm_size=1,
                    use_linear_silu=False, blend_cache_dir="", blend_index_dir="", reset_attention_mask=True,
                    eod_mask_loss=False, pad_id=0, bos_id=1,
                    calculate_per_token_loss=True)
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg.routed_bias_dtype_resolved == cfg.weight_dtype


def test_ling2_layer_types():
    cfg = load_config(model_name="ling2")
    mla = [i for i, t in enumerate(cfg.layer_types) if t == "mla"]
    assert mla == [4, 9, 14, 19]
    assert cfg.mlp_types == ("dense",) + ("moe",) * 19
    assert cfg.qk_head_dim == 192 and cfg.rotary_dim == 64


def test_tail_rule_makes_trailing_partial_group_mla():
    # L=12, interval 5: groups [0..4], [5..9]; layers 10 and 11 form a partial group -> MLA.
    cfg = load_config(model_name="ling2-tiny", base_num_decoder_layers=12)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "mla"] == [4, 9, 10, 11]
    cfg = load_config(model_name="ling2-tiny", inhomogeneous_layer_cycle_interval=1)
    assert set(cfg.layer_types) == {"mla"}


def test_tiny_structure():
    cfg = load_config(model_name="ling2-tiny")
    assert cfg.base_num_decoder_layers == 10
    assert [i for i, t in enumerate(cfg.layer_types) if t == "mla"] == [4, 9]
    assert cfg.mlp_types[0] == "dense" and set(cfg.mlp_types[1:]) == {"moe"}
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_routing_groups, cfg.topk_routing_group) == (16, 4, 4, 2)
    assert cfg.mtp_num_layers == 1


@pytest.mark.parametrize("model", ["ling2", "ling2-tiny", "ling2-small"])
def test_model_files_load(model):
    cfg = load_config(f"model_name={model}")
    assert cfg.model_name == model


def test_override_order_and_coercion():
    cfg = load_config("model_name=ling2", "num_experts=64", "routed_scaling_factor=1", "scan_layers=true")
    assert cfg.num_experts == 64  # override beats the model file
    assert cfg.routed_scaling_factor == 1.0 and isinstance(cfg.routed_scaling_factor, float)
    assert cfg.scan_layers is True
    assert cfg.num_experts_per_tok == 8  # from the model file
    # kwargs and mappings work too, applied in order
    assert load_config({"num_experts": 16}, num_experts=32).num_experts == 32


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.num_experts = 3


def test_base_yml_defines_every_field():
    import yaml
    keys = set(yaml.safe_load(BASE_CONFIG.read_text()))
    assert keys == set(Config.model_fields)


# ---- bad input -------------------------------------------------------------

def test_unknown_key_names_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'num_expert'.*num_experts"):
        load_config("num_expert=4")


@pytest.mark.parametrize("key, value", [("decoder_block", "ling2"), ("attention_type", "mla"), ("opt_type", "adamw"),
                                        ("enable_dropout", False), ("dropout_rate", 0.0)])
def test_removed_keys_are_named_errors(tmp_path, key, value):
    """Keys Ling2 no longer reads are refused, in a file or an override, saying they were removed and why."""
    with pytest.raises(ConfigError, match=rf"override: config key '{key}' was removed: .+; delete it"):
        load_config(**{key: value})
    f = tmp_path / "old.yml"
    f.write_text(f"base_config: {BASE_CONFIG}\n{key}: {value!r}\n")
    with pytest.raises(ConfigError, match=rf"{f}: config key '{key}' was removed"):
        load_config(config_file=f)


def test_unknown_key_in_file_names_file(tmp_path):
    f = tmp_path / "my.yml"
    f.write_text(f"base_config: {BASE_CONFIG}\nlerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"my\.yml: unknown config key 'lerning_rate'.*learning_rate"):
        load_config(config_file=f)


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"num_experts \(from override\).*integer.*'abc'"):
        load_config("num_experts=abc")
    with pytest.raises(ConfigError, match=r"dtype.*'float33'"):
        load_config(dtype="float33")


@pytest.mark.parametrize("key,value", [("moe_ep_capacity_factor", "nan"), ("learning_rate", "inf"),
                                       ("rope_factor", "-inf")])
def test_non_finite_floats_name_the_field(key, value):
    """nan and inf are refused in every float field (never a NaN step or an unbounded buffer later)."""
    with pytest.raises(ConfigError, match=rf"{key} \(from override\).*finite number.*'{value}'"):
        load_config(model_name="ling2-tiny", **{key: value})


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config("num_experts")


@pytest.mark.parametrize("overrides, field", [
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts=8, n_routing_groups=3), "n_routing_groups"),
    (dict(num_experts=8, n_routing_groups=2, topk_routing_group=3), "topk_routing_group"),
    (dict(inhomogeneous_layer_cycle_interval=0), "inhomogeneous_layer_cycle_interval"),
    (dict(base_emb_dim=0), "base_emb_dim"),
    (dict(head_dim=-4), "head_dim"),
    (dict(weight_dtype="int8"), "weight_dtype"),
    (dict(routed_bias_dtype="fp32"), "routed_bias_dtype"),
    (dict(group_norm_size=3), "group_norm_size"),
    (dict(qk_rope_head_dim=32), "qk_rope_head_dim"),
    (dict(num_experts=8, n_routing_groups=8, topk_routing_group=2), "n_routing_groups"),
    (dict(ici_data_parallelism=-1, ici_fsdp_parallelism=-1), "ici_"),
    (dict(ici_tensor_parallelism=0), "ici_tensor_parallelism"),
    (dict(attention_block_size=0), "attention_block_size"),
    (dict(attention_kernel="flash2"), "attention_kernel"),
])
def test_validation_rules_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(**overrides)


@pytest.mark.parametrize("override, message", [
    ("steps=true", "steps: expected a number, got true"),
    ("learning_rate=false", "learning_rate: expected a number, got false"),
    ("adam_b1=1.5", r"adam_b1 \(from override\).*less than 1"),
    ("adam_b2=-0.1", r"adam_b2 \(from override\).*greater than or equal to 0"),
])
def test_numbers_are_numbers_and_adam_betas_are_in_0_1(override, message):
    """YAML's true would otherwise count as 1 step; a beta of 1 or more makes Adam's moments diverge."""
    with pytest.raises(ConfigError, match=message):
        load_config(override)
    assert load_config("scan_layers=true").scan_layers is True  # booleans stay booleans


def test_a_key_given_twice_in_a_file_is_an_error(tmp_path):
    f = tmp_path / "twice.yml"
    f.write_text(f"base_config: {BASE_CONFIG}\nseed: 1\nsteps: 3\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"twice\.yml: malformed YAML(.|\n)*duplicate key 'seed'(.|\n)*line 4"):
        load_config(config_file=f)


def test_a_wsd_warmup_and_decay_longer_than_the_run_are_named():
    """The decay would be cut off by the end of the run, its learning rate never reaching final_lr_fraction."""
    with pytest.raises(ConfigError, match=r"wsd_decay_steps_fraction: 0.5 \+ warmup_steps_fraction=0.8 exceed the run"):
        load_config("lr_schedule=wsd", "warmup_steps_fraction=0.8", "wsd_decay_steps_fraction=0.5")
    assert load_config("lr_schedule=wsd", "warmup_steps_fraction=0.5", "wsd_decay_steps_fraction=0.5").lr_schedule == "wsd"
    load_config("lr_schedule=cosine", "warmup_steps_fraction=0.8", "wsd_decay_steps_fraction=0.5")  # unused there


@pytest.mark.parametrize("override, message", [
    ("data_seed=-1", r"data_seed \(from override\): Input should be greater than or equal to 0"),
    ("data_seed=4294967296", r"data_seed \(from override\): Input should be less than or equal to 4294967295"),
    ("seed=9223372036854775808", r"seed \(from override\): Input should be less than or equal to 9223372036854775807"),
    ("steps=99999999999999999999999", r"steps \(from override\): Input should be less than or equal to 2147483647"),
])
def test_seeds_and_steps_are_in_the_range_their_consumers_take(override, message):
    """numpy's RandomState (Megatron's shuffles) takes [0, 2^32); a JAX key a 64-bit integer; the schedule's step
    count is an int32 on the device: past them, the run used to stop with a ValueError that did not name the field,
    or an OverflowError traceback (--dry_run, which reads no data)."""
    with pytest.raises(ConfigError, match=message):
        load_config(override)
    assert load_config("seed=-1").seed == -1 and load_config("data_seed=4294967295").data_seed == 2**32 - 1


@pytest.mark.parametrize("key, shown", [("3", r"3 \(int\)"), ("~", r"None \(NoneType\)"), ("true", r"True \(bool\)")])
def test_a_key_that_is_not_a_string_names_the_file(tmp_path, key, shown):
    f = tmp_path / "keys.yml"
    f.write_text(f"base_config: {BASE_CONFIG}\n{key}: 4\n")
    with pytest.raises(ConfigError, match=rf"keys\.yml: config key {shown} is not a field name"):
        load_config(config_file=f)


def test_malformed_yaml_names_file(tmp_path):
    f = tmp_path / "bad.yml"
    f.write_text("num_experts: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yml: malformed YAML"):
        load_config(config_file=f)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yml: config file not found"):
        load_config(config_file=tmp_path / "nope.yml")


def test_missing_model_file_names_path():
    # ModelName is a closed Literal: an unknown name cannot get past the loader to the schema.
    with pytest.raises(ConfigError, match=r"models/ling9\.yml: model file .* not found"):
        load_config(model_name="ling9")


def test_missing_model_file_in_custom_tree(tmp_path):
    (tmp_path / "base.yml").write_text(BASE_CONFIG.read_text())
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match=r"models/ling2-tiny\.yml: model file"):
        load_config(config_file=tmp_path / "base.yml", model_name="ling2-tiny")


def test_incomplete_root_file(tmp_path):
    f = tmp_path / "partial.yml"
    f.write_text("num_experts: 4\n")
    with pytest.raises(ConfigError, match=r"partial\.yml: missing config keys") as e:
        load_config(config_file=f)
    assert re.search(r"and \d+ more", str(e.value)) and "`base_config: <path>`" in str(e.value)  # the likely slip
    with pytest.raises(ConfigError, match=r"model file for model_name='ling2-tiny' not found .*base_config"):
        load_config(config_file=f, model_name="ling2-tiny")


def test_configs_dir_is_the_repo_one():
    assert (CONFIGS_DIR / "models" / "ling2.yml").is_file()


@pytest.mark.parametrize("overrides, message", [
    (dict(pad_id=32000), r"pad_id: 32000 is outside the vocabulary \[0, vocab_size=32000\) \(-1 means none\)"),
    (dict(pad_id=-2), r"pad_id: -2 is outside the vocabulary"),
    (dict(bos_id=40000), r"bos_id: 40000 is outside the vocabulary \[0, vocab_size=32000\)"),
    (dict(eod_id=-1), r"eod_id: -1 is outside the vocabulary \[0, vocab_size=32000\)"),
    (dict(vocab_size=100, eod_id=100), r"eod_id: 100 is outside the vocabulary \[0, vocab_size=100\)"),
    (dict(add_bos=True, bos_id=-1), r"add_bos: needs a bos_id"),
    (dict(blend_per_split=["a", "b"]), r"blend_per_split: want \[\] or 3 entries"),
    (dict(data_path="a", blend_per_split=["a", "", ""]), r"blend_per_split: cannot be used with data_path"),
])
def test_special_ids_and_data_fields_are_checked(overrides, message):
    """Hand-made: special ids outside the vocabulary would train on embedding rows that wrap or
    do not exist; -1 means none for pad_id and bos_id only."""
    with pytest.raises(ConfigError, match=message):
        load_config(**overrides)


def test_special_ids_in_range_load():
    cfg = load_config(vocab_size=100, pad_id=-1, bos_id=99, eod_id=0,
                      blend_per_split=["a", "", "0.5 b 0.5 c"])
    assert (cfg.pad_id, cfg.bos_id, cfg.eod_id) == (-1, 99, 0)
    assert cfg.blend_per_split == ["a", "", "0.5 b 0.5 c"]


def test_ling3_layer_rule_keeps_a_trailing_partial_group_linear():
    """Ling 3 (reference: transformers' BailingHybridConfig): layer i is MLA iff (i+1) % G == 0, so a
    trailing partial group stays KDA; Ling2's GLA rule makes that tail MLA."""
    kda = load_config(model_name="ling3-tiny", base_num_decoder_layers=6, inhomogeneous_layer_cycle_interval=4)
    assert kda.layer_types == ("kda", "kda", "kda", "mla", "kda", "kda")
    gla = load_config(model_name="ling2-tiny", base_num_decoder_layers=6, inhomogeneous_layer_cycle_interval=4)
    assert gla.layer_types == ("gla", "gla", "gla", "mla", "mla", "mla")
    real = load_config(model_name="ling3")
    assert real.layer_types.count("mla") == 7 and real.layer_types[5] == "mla" and real.layer_types[-1] == "mla"
    assert real.rotary_dim == real.qk_rope_head_dim == 64 and real.head_dim == 128
    with pytest.raises(ConfigError, match="kda_chunk_size"):
        load_config(model_name="ling3-tiny", kda_chunk_size=48)


@pytest.mark.parametrize("overrides, message", [
    (dict(model_name="ling2-micro", max_target_length=32, gla_chunk_size=8, ici_context_parallelism=8),
     r"ici_context_parallelism: context parallelism 8 needs max_target_length \(32\) to be a multiple of "
     r"context x gla_chunk_size = 8 x 8"),
    (dict(model_name="ling3-tiny", max_target_length=256, kda_chunk_size=64, ici_context_parallelism=2,
          dcn_context_parallelism=4), r"context parallelism 8 needs .* 8 x 64"),
    (dict(model_name="ling2-micro", max_target_length=24, gla_chunk_size=3, ici_context_parallelism=8),
     r"context parallelism 8 needs max_target_length \(24\) to be a multiple of 2 x context"),
    (dict(model_name="ling2-micro", max_target_length=512, attention_kernel="flash", ici_context_parallelism=4),
     r"context parallelism 4 with attention_kernel=flash needs max_target_length \(512\) / \(2 x context\) to be "
     r"a multiple of 128"),
])
def test_context_parallelism_must_split_whole_kernel_chunks(overrides, message):
    """Hand-made: each context shard must hold whole chunks of the linear-attention kernel."""
    with pytest.raises(ConfigError, match=message):
        load_config(**overrides)
    ok = dict(overrides, max_target_length=2 * overrides["max_target_length"])
    if "dcn_context_parallelism" not in overrides:
        assert load_config(**ok).ici_context_parallelism == overrides["ici_context_parallelism"]


def test_long_context_configs():
    """configs/train's extension stages: ling2 32K -> 128K -> 256K by YaRN over the 4K of pre-training (each
    stage inherits the one before), ling3 at 128K within its native RoPE; a sequence split over 4 context shards,
    8 at 256K."""
    from ling2.config.paths import find_file

    k32 = load_config(config_file=find_file("configs/train/ling2-32k.yml"))
    k128 = load_config(config_file=find_file("configs/train/ling2-128k.yml"))
    k256 = load_config(config_file=find_file("configs/train/ling2-256k.yml"))
    l3 = load_config(config_file=find_file("configs/train/ling3-128k.yml"))
    assert (k32.rope_type, k32.rope_factor, k32.max_target_length) == ("yarn", 8, 32768)
    assert (k128.rope_type, k128.rope_factor, k128.max_target_length) == ("yarn", 32, 131072)
    assert (k256.rope_type, k256.rope_factor, k256.max_target_length) == ("yarn", 64, 262144)
    assert k256.original_max_position_embeddings == 4096 and k256.max_position_embeddings == 262144
    assert (l3.rope_type, l3.max_target_length, l3.max_position_embeddings) == ("default", 131072, 262144)
    for cfg, context in ((k32, 4), (k128, 4), (k256, 8), (l3, 4)):
        assert cfg.ici_context_parallelism == context and cfg.context_problem(context) is None


@pytest.mark.parametrize("proxy, full, differ, layer_types", [
    ("ling2-1gpu", "ling2", {"num_experts": 64, "base_num_decoder_layers": 10},
     ("gla",) * 4 + ("mla",) + ("gla",) * 4 + ("mla",)),
    ("ling3-1gpu", "ling3", {"num_experts": 64, "base_num_decoder_layers": 6, "first_num_dense_layers": 1},
     ("kda",) * 5 + ("mla",)),
])
def test_one_gpu_proxies_are_their_model_at_its_widths_with_fewer_layers_and_local_experts(
        proxy, full, differ, layer_types):
    """configs/models/{ling2,ling3}-1gpu.yml (tools/bench/gpu/mfu.py): the full model's widths, 64 of its experts
    (one expert-parallel slice), fewer layers with the first dense, MTP 1, the vocab-blocked loss, cuDNN MLA
    where cuDNN takes the head dims, scanned (the scanned layout: tools/bench/gpu/mfu_test.py)."""
    cfg, ref = load_config(model_name=proxy), load_config(model_name=full)
    got, want = cfg.model_dump(), ref.model_dump()
    changed = {k for k in want if got[k] != want[k]} - {"model_name", "layer_types", "mlp_types"}
    assert changed == set(differ) | {"attention_kernel", "scan_layers"}
    assert {k: got[k] for k in differ} == differ
    assert ref.num_experts % cfg.num_experts == 0
    assert (cfg.attention_kernel, cfg.scan_layers) == ("cudnn", True)
    assert (cfg.mtp_num_layers, cfg.vocab_size, cfg.loss_vocab_blocks, cfg.num_experts_per_tok) == (1, 157184, 16, 8)
    assert cfg.layer_types == layer_types
    assert cfg.mlp_types == ("dense",) + ("moe",) * (len(layer_types) - 1)
