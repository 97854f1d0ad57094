"""HF <-> Ling2 conversion: round trips, config mapping, validation errors, file format."""

import json
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from ling2.checkpoint import state as ckpt_state
from ling2.checkpoint.safetensors_io import INDEX_NAME, ShardedReader, ShardedWriter
from ling2.config import load_config
from ling2.convert import convert, hf_config, hf_to_ling2, ling2_to_hf
from ling2.convert.testing.hf_fixtures import write_random_hf


@pytest.fixture(scope="module")
def tiny():
    return load_config(model_name="ling2-tiny")


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory, tiny):
    d = tmp_path_factory.mktemp("hf")
    return d, write_random_hf(d, tiny)


@pytest.mark.parametrize("scan", [False, True])
def test_round_trip_is_bit_identical(tmp_path, hf_tiny, scan):
    hf_dir, ref = hf_tiny
    assert len(json.loads((hf_dir / INDEX_NAME).read_text())["weight_map"]) == len(ref)
    assert len(set(json.loads((hf_dir / INDEX_NAME).read_text())["weight_map"].values())) > 1
    cfg = convert.convert_hf_to_ling2(hf_dir, tmp_path / "l2", scan_layers=scan, progress=False)
    assert cfg.scan_layers == scan
    state = ckpt_state.load_state(tmp_path / "l2", cfg)
    if scan:  # layer 5 is the first of the scanned groups (the prefix holds the dense layer's group)
        assert state["decoder"]["groups"]["layers"][0]["attention"]["qkv"].shape[0] == 1
    other_cfg = load_config(cfg.model_dump(exclude={"model_name"}), scan_layers=not scan)
    other = ckpt_state.load_state(tmp_path / "l2", other_cfg)  # saved with `scan`, loaded in the other layout
    again = ckpt_state.relayout(other, other_cfg, cfg)
    assert jax.tree.all(jax.tree.map(np.array_equal, again, state))  # scanned <-> unscanned loses nothing
    convert.convert_ling2_to_hf(tmp_path / "l2", tmp_path / "hf2", progress=False, shard_bytes=1 << 20)
    out = ShardedReader(tmp_path / "hf2")
    assert sorted(out.names()) == sorted(ref)
    for n, a in ref.items():
        got = out.read(n)
        assert got.dtype == a.dtype and np.array_equal(got, a), n


def test_layouts_place_tensors_as_the_model_uses_them(tmp_path, hf_tiny):
    """Spot checks against the HF layout written out by hand (independent of mapping.py)."""
    hf_dir, ref = hf_tiny
    cfg = convert.convert_hf_to_ling2(hf_dir, tmp_path / "l2", progress=False)
    s = ckpt_state.load_state(tmp_path / "l2", cfg)["decoder"]
    E, H, D = 128, 4, 32
    qkv = ref["model.layers.1.attention.query_key_value.weight"]  # [3HD, E]: q heads, k heads, v heads
    np.testing.assert_array_equal(s["layers"][1]["attention"]["qkv"][:, 1, 2, 5], qkv[1 * H * D + 2 * D + 5])
    dense = ref["model.layers.1.attention.dense.weight"]  # [E, HD]
    np.testing.assert_array_equal(s["layers"][1]["attention"]["dense"][3, 7], dense[:, 3 * D + 7])
    kv_b = ref["model.layers.4.attention.kv_b_proj.weight"]  # [H*(nope+v), kv_lora]
    np.testing.assert_array_equal(s["layers"][4]["attention"]["kv_b"][:, 2, 40], kv_b[2 * 64 + 40])
    up = ref["model.layers.6.mlp.experts.11.up_proj.weight"]  # [I, E]
    np.testing.assert_array_equal(s["layers"][6]["mlp"]["experts"]["up_proj"][11], up.T)
    np.testing.assert_array_equal(s["lm_head"]["kernel"], ref["lm_head.weight"].T)
    np.testing.assert_array_equal(s["layers"][6]["mlp"]["gate"]["expert_bias"], ref["model.layers.6.mlp.gate.expert_bias"])
    m = ckpt_state.load_state(tmp_path / "l2", cfg)["mtp"]["depths"][0]
    np.testing.assert_array_equal(m["eh_proj"], ref["model.layers.10.eh_proj.weight"].T)
    np.testing.assert_array_equal(m["final_norm"]["weight"], ref["model.layers.10.final_layernorm.weight"])
    assert E == cfg.base_emb_dim and H == cfg.base_num_query_heads and D == cfg.head_dim


def test_bf16_round_trip(tmp_path, tiny):
    cfg = load_config(model_name="ling2-tiny", base_num_decoder_layers=5, weight_dtype="bfloat16")
    ref = write_random_hf(tmp_path / "hf", cfg, dtype=np.dtype("bfloat16"))
    c2 = convert.convert_hf_to_ling2(tmp_path / "hf", tmp_path / "l2", dtype="bf16", progress=False)
    assert c2.weight_dtype == "bfloat16" and c2.routed_bias_dtype == "float32"
    convert.convert_ling2_to_hf(tmp_path / "l2", tmp_path / "hf2", progress=False)
    out = ShardedReader(tmp_path / "hf2")
    for n, a in ref.items():
        got = out.read(n)
        if n.endswith("expert_bias"):  # kept in fp32 (routed_bias_dtype), exact for bf16 values
            assert got.dtype == np.float32 and np.array_equal(got, a.astype(np.float32)), n
        else:
            assert got.dtype == a.dtype and np.array_equal(got.view(np.uint16), a.view(np.uint16)), n
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["torch_dtype"] == "bfloat16"


MODEL_FIELDS = ["vocab_size", "base_emb_dim", "base_mlp_dim", "base_num_decoder_layers", "base_num_query_heads",
                "head_dim", "inhomogeneous_layer_cycle_interval", "first_num_dense_layers", "mtp_num_layers",
                "moe_shared_expert_dim", "shared_experts", "n_routing_groups", "topk_routing_group",
                "routed_score_func", "routed_scaling_factor", "rope_max_timescale", "rope_type", "rope_factor",
                "partial_rotary_factor", "group_norm_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "num_experts", "num_experts_per_tok", "base_moe_mlp_dim",
                "mla_interleaved_rope", "use_qk_norm", "use_linear_silu", "normalization_layer_epsilon",
                "logits_via_embedding", "routed_bias", "original_max_position_embeddings", "mscale_all_dim"]


@pytest.mark.parametrize("model", ["ling2-tiny", "ling2"])
def test_config_round_trip(model):
    cfg = load_config(model_name=model, rope_type="yarn", rope_factor=4.0, mscale_all_dim=1.0)
    hf = hf_config.config_to_hf(cfg, "bailing")
    back = hf_config.load_ling2_config(json.loads(json.dumps(hf)), "bailing")
    assert {f: getattr(back, f) for f in MODEL_FIELDS} == {f: getattr(cfg, f) for f in MODEL_FIELDS}


def test_config_fields_from_a_bailing_config_json():
    """Hand-written HF fields (names of configuration_bailing_moe_v2_5.py) -> Ling2 fields."""
    hf = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7,
          "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 512, "rope_theta": 600000.0, "num_experts": 16, "num_shared_experts": 2,
          "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 8,
          "first_k_dense_replace": 2, "num_nextn_predict_layers": 1, "routed_scaling_factor": 2.5,
          "layer_group_size": 3, "group_norm_size": 2, "kv_lora_rank": 32, "q_lora_rank": None,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "partial_rotary_factor": 0.5,
          "score_function": "sigmoid", "rope_scaling": {"type": "yarn", "factor": 8.0,
                                                        "original_max_position_embeddings": 64}}
    cfg = hf_config.load_ling2_config(hf, "bailing")
    assert cfg.inhomogeneous_layer_cycle_interval == 3 and cfg.first_num_dense_layers == 2
    assert cfg.mtp_num_layers == 1 and cfg.moe_shared_expert_dim == 16 and cfg.shared_experts == 1
    assert (cfg.n_routing_groups, cfg.topk_routing_group, cfg.routed_scaling_factor) == (4, 2, 2.5)
    assert (cfg.rope_type, cfg.rope_factor, cfg.original_max_position_embeddings) == ("yarn", 8.0, 64)
    assert cfg.rope_max_timescale == 600000.0 and cfg.group_norm_size == 2 and cfg.q_lora_rank == 0
    assert cfg.layer_types == ("gla", "gla", "mla", "gla", "gla", "mla", "mla")
    hf["moe_shared_expert_intermediate_size"] = 24
    assert hf_config.load_ling2_config(hf, "bailing").moe_shared_expert_dim == 24
    missing = hf_config.load_ling2_config({k: v for k, v in hf.items() if k != "layer_group_size"}, "bailing")
    assert missing.inhomogeneous_layer_cycle_interval == 5  # the official class's default
    with pytest.raises(hf_config.HFConfigError, match=r"layer_group_size \(Ling2 inhomogeneous_layer_cycle_interval\)"):
        hf_config.load_ling2_config({**hf, "layer_group_size": 0}, "bailing")


def test_validation_lists_every_offender_with_both_shapes(tmp_path, tiny):
    drop = ("model.layers.3.attention.g_proj.weight", "model.layers.7.mlp.experts.2.down_proj.weight")
    bad = {"model.layers.4.attention.kv_b_proj.weight": np.zeros((3, 64), np.float32),
           "model.layers.99.mlp.gate.weight": np.zeros((16, 128), np.float32)}
    ref = write_random_hf(tmp_path, tiny, drop=drop)
    ref.update(bad)
    w = ShardedWriter(tmp_path, shard_bytes=1 << 30)
    for n, a in ref.items():
        w.add(n, a)
    w.close()
    with pytest.raises(convert.ConversionError) as e:
        convert.hf_to_state(ShardedReader(tmp_path), tiny, "bailing", progress=False)
    msg = str(e.value)
    assert "2 missing, 1 unexpected, 1 mis-shaped" in msg
    assert "missing: model.layers.3.attention.g_proj.weight expected (128, 128)" in msg
    assert "missing: model.layers.7.mlp.experts.2.down_proj.weight expected (128, 64)" in msg
    assert "unexpected: model.layers.99.mlp.gate.weight checkpoint (16, 128)" in msg
    assert "mis-shaped: model.layers.4.attention.kv_b_proj.weight checkpoint (3, 64) vs expected (256, 64)" in msg


def test_integer_or_bool_tensors_are_not_weights(tmp_path, tiny, capsys):
    """An int or bool tensor where a float weight belongs is refused by name with both dtypes (casting it would
    load made-up weights, exit 0); a float tensor of another width is still cast."""
    kv_b, norm, up = ("model.layers.4.attention.kv_b_proj.weight", "model.norm.weight",
                      "model.layers.6.mlp.experts.3.up_proj.weight")
    ref = write_random_hf(tmp_path / "ok", tiny, extra={up: np.ones((64, 128), np.float16)})
    state = convert.hf_to_state(ShardedReader(tmp_path / "ok"), tiny, "bailing", progress=False)
    np.testing.assert_array_equal(state["decoder"]["layers"][6]["mlp"]["experts"]["up_proj"][3], ref[up].T)
    write_random_hf(tmp_path / "bad", tiny, extra={kv_b: np.ones((256, 64), np.int32), norm: np.ones(128, np.bool_)})
    with pytest.raises(convert.ConversionError) as e:
        convert.hf_to_state(ShardedReader(tmp_path / "bad"), tiny, "bailing", progress=False)
    msg = str(e.value)
    assert "0 missing, 0 unexpected, 0 mis-shaped, 2 of a wrong dtype" in msg
    assert f"wrong dtype: {kv_b} checkpoint int32 vs expected float32" in msg
    assert f"wrong dtype: {norm} checkpoint bool vs expected float32" in msg
    assert hf_to_ling2.main(["--hf_dir", str(tmp_path / "bad"), "--out", str(tmp_path / "l2"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ConversionError:") and f"{kv_b} checkpoint int32 vs expected float32" in err
    assert not (tmp_path / "l2" / "state").exists()


def test_missing_mtp_needs_the_flag(tmp_path, tiny):
    mtp = [n for n in write_random_hf(tmp_path / "a", tiny) if n.startswith("model.layers.10.")]
    ref = write_random_hf(tmp_path / "b", tiny, drop=mtp)
    with pytest.raises(convert.ConversionError, match=r"--allow_missing_mtp") as e:
        convert.hf_to_state(ShardedReader(tmp_path / "b"), tiny, "bailing", progress=False)
    assert f"{len(mtp)} missing, 0 unexpected" in str(e.value)
    state = convert.hf_to_state(ShardedReader(tmp_path / "b"), tiny, "bailing", allow_missing_mtp=True,
                                progress=False)
    np.testing.assert_array_equal(state["decoder"]["lm_head"]["kernel"], ref["lm_head.weight"].T)
    assert state["mtp"]["depths"][0]["eh_proj"].shape == (256, 128)
    assert np.std(state["mtp"]["depths"][0]["eh_proj"]) > 0  # seeded init, not garbage or zeros
    partial = write_random_hf(tmp_path / "c", tiny, drop=mtp[:1])
    assert len(partial) == len(ref) + len(mtp) - 1
    with pytest.raises(convert.ConversionError, match="1 missing"):  # a partial MTP is still an error
        convert.hf_to_state(ShardedReader(tmp_path / "c"), tiny, "bailing", allow_missing_mtp=True, progress=False)


def test_expert_bias_accepts_e_score_correction_bias(tmp_path, tiny):
    old = "model.layers.6.mlp.gate.expert_bias"
    ref = write_random_hf(tmp_path, tiny, rename={old: "model.layers.6.mlp.gate.e_score_correction_bias"})
    state = convert.hf_to_state(ShardedReader(tmp_path), tiny, "bailing", progress=False)
    np.testing.assert_array_equal(state["decoder"]["layers"][6]["mlp"]["gate"]["expert_bias"],
                                  ref["model.layers.6.mlp.gate.e_score_correction_bias"])


def test_written_shards_read_by_the_safetensors_package(tmp_path, hf_tiny):
    hf_dir, ref = hf_tiny
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    seen = {}
    for shard in sorted(set(index["weight_map"].values())):
        seen.update(safetensors.numpy.load_file(hf_dir / shard))
    assert sorted(seen) == sorted(ref)
    assert all(np.array_equal(seen[n], ref[n]) for n in ref)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in ref.values())


def test_cli_both_directions(tmp_path, hf_tiny, capsys):
    hf_dir, ref = hf_tiny
    assert hf_to_ling2.main(["--hf_dir", str(hf_dir), "--out", str(tmp_path / "l2"), "--scan_layers",
                             "--no_progress", "--set", "max_target_length=128"]) == 0
    assert "scan_layers=True" in capsys.readouterr().out
    assert ckpt_state.read_config(tmp_path / "l2" / "config.yml").max_target_length == 128
    assert ling2_to_hf.main(["--ckpt", str(tmp_path / "l2"), "--out", str(tmp_path / "hf2"), "--no_progress",
                             "--shard_gb", "0.001"]) == 0
    assert f"{len(ref)} tensors" in capsys.readouterr().out
    out = ShardedReader(tmp_path / "hf2")
    assert all(np.array_equal(out.read(n), a) for n, a in ref.items())
    assert hf_to_ling2.main(["--hf_dir", str(tmp_path), "--out", str(tmp_path / "x"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert "error: ConversionError:" in err and f"{tmp_path}/config.json: not found" in err


def test_deepseek_layout_with_mtp_round_trip(tmp_path):
    """DeepSeek-V3 names (embed_tokens, self_attn.o_proj, e_score_correction_bias, shared_head.norm) both ways.

    The MTP layer's own copies of embed_tokens / shared_head.head duplicate the shared ones and are skipped.
    """
    hf = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "n_shared_experts": 2,
          "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 12,
          "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8, "n_group": 2, "topk_group": 1,
          "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
          "max_position_embeddings": 64, "num_nextn_predict_layers": 1, "model_type": "deepseek_v3"}
    cfg = hf_config.load_ling2_config(hf, hf_config.detect_layout(hf))
    assert cfg.layer_types == ("mla",) * 3 and cfg.shared_experts * cfg.shared_expert_dim == 32
    dup = {"model.layers.3.embed_tokens.weight": np.ones((64, 32), np.float32),
           "model.layers.3.shared_head.head.weight": np.ones((64, 32), np.float32)}
    ref = write_random_hf(tmp_path / "hf", cfg, layout="deepseek_v3", extra=dup)
    assert "model.layers.3.shared_head.norm.weight" in ref and "model.layers.1.self_attn.o_proj.weight" in ref
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in ref
    c2 = convert.convert_hf_to_ling2(tmp_path / "hf", tmp_path / "l2", progress=False)
    assert c2.mtp_num_layers == 1 and c2.inhomogeneous_layer_cycle_interval == 1
    convert.convert_ling2_to_hf(tmp_path / "l2", tmp_path / "hf2", layout="deepseek_v3", progress=False)
    out = ShardedReader(tmp_path / "hf2")
    assert sorted(out.names()) == sorted(set(ref) - set(dup))
    assert all(np.array_equal(out.read(n), ref[n]) for n in out.names())
    back = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert back["model_type"] == "deepseek_v3" and back["n_shared_experts"] == 2 and back["n_routed_experts"] == 8
    with pytest.raises(hf_config.HFConfigError, match="every layer must be MLA"):
        hf_config.config_to_hf(load_config(model_name="ling2-tiny"), "deepseek_v3")


def test_loading_with_another_config_lists_every_mismatch(tmp_path, hf_tiny, tiny):
    hf_dir, _ = hf_tiny
    convert.convert_hf_to_ling2(hf_dir, tmp_path / "l2", progress=False)
    other = load_config(model_name="ling2-tiny", base_moe_mlp_dim=32)
    with pytest.raises(ckpt_state.CheckpointError) as e:
        ckpt_state.load_state(tmp_path / "l2", other)
    msg = str(e.value)
    assert "decoder/layers/6/mlp/experts/down_proj: checkpoint (16, 64, 128) vs model (16, 32, 128)" in msg
    assert "mtp/depths/0/layer/mlp/experts/up_proj: checkpoint (16, 128, 64) vs model (16, 128, 32)" in msg


def test_malformed_safetensors_name_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="model.safetensors: malformed safetensors header"):
        ShardedReader(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="names shard gone.safetensors, which does not exist"):
        ShardedReader(tmp_path)
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        ShardedReader(tmp_path / "hf_missing")


def _safetensors_file(path, header, data: bytes):
    """A safetensors file with this header (a dict, or raw JSON bytes) and data section, built by hand."""
    import struct

    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


_A = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
_B = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}


@pytest.mark.parametrize("case,header,data,message", [
    ("a gap", {"a": {**_A, "data_offsets": [8, 24]}}, bytes(24), r"bytes \[0, 8\) of the data belong to no tensor"),
    ("a gap between two", {"a": _A, "b": {**_B, "data_offsets": [20, 28]}}, bytes(28),
     r"bytes \[16, 20\) of the data belong to no tensor \(the next is b\)"),
    ("bytes after the data", {"a": _A}, bytes(24), r"8 bytes after the last tensor's end \(data byte 16\)"),
    ("metadata a list", {"__metadata__": [1], "a": _A}, bytes(16), r"__metadata__ must map strings to strings"),
    ("metadata values not strings", {"__metadata__": {"format": 1}, "a": _A}, bytes(16),
     r"__metadata__ must map strings to strings"),
])
def test_malformed_safetensors_the_reference_refuses_are_refused(tmp_path, case, header, data, message):
    """Files the safetensors package (the format's reference) refuses to load, ShardedReader refuses too, naming
    the file and the bytes: the format's data section is the tensors end to end, with no hole and no tail, and
    __metadata__ is a map of strings. The same file made whole loads in both."""
    import safetensors

    f = tmp_path / case.replace(" ", "_") / "model.safetensors"
    _safetensors_file(f, header, data)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.numpy.load_file(f)
    with pytest.raises(ValueError, match=rf"{re.escape(str(f))}: (malformed safetensors header: )?{message}"):
        ShardedReader(f.parent)
    _safetensors_file(f, {"a": _A, "b": _B}, np.arange(6, dtype=np.float32).tobytes())
    assert safetensors.numpy.load_file(f)["b"].tolist() == ShardedReader(f.parent).read("b").tolist() == [4.0, 5.0]


def test_a_header_naming_a_tensor_twice_is_refused(tmp_path):
    """JSON keeps the last of two equal keys silently; a header giving tensor a two places (the first as its own
    bytes) is refused by name instead of read from either."""
    f = tmp_path / "model.safetensors"
    _safetensors_file(f, b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                         b'"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', bytes(16))
    with pytest.raises(ValueError, match=r"model\.safetensors: malformed safetensors header: key 'a' appears twice"):
        ShardedReader(tmp_path)


def test_planned_writer_blocks_views_and_casts(tmp_path):
    """Blocks written at their offsets, in any order, from transposed views and with a cast; read back alone."""
    from ling2.checkpoint.safetensors_io import CHUNK, PlannedWriter

    rng = np.random.default_rng(0)
    big = rng.standard_normal((3, 600, CHUNK // 4 // 300)).astype(np.float32)  # each block spans several chunks
    w = PlannedWriter(tmp_path, [("a", (2, 3), np.float32), ("big", big.shape, "bfloat16")], shard_bytes=1)
    for g in (2, 0, 1):
        w.add("big", big[g].T.copy().T, (g,))  # a non-contiguous view, cast fp32 -> bf16 on the way
    with pytest.raises(ValueError, match="12582000 of 12582024 planned bytes written"):
        w.close()
    with pytest.raises(ValueError, match=r"tensor a\[\] is \(3, 2\) float32, planned \(2, 3\) float32"):
        w.add("a", np.zeros((3, 2), np.float32))
    w.add("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    index = w.close()
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    got = safetensors.numpy.load_file(tmp_path / index["weight_map"]["big"])["big"]  # the reference reader
    np.testing.assert_array_equal(got, big.astype(jax.numpy.bfloat16))
    r = ShardedReader(tmp_path)
    np.testing.assert_array_equal(r.read("big", (1,), copy=False), big[1].astype(jax.numpy.bfloat16))
    np.testing.assert_array_equal(r.read("a", (1,)), [3, 4, 5])


@pytest.mark.parametrize("threads", [0, 2])
def test_planned_writer_gathers_small_blocks_in_any_order(tmp_path, threads):
    """Small transposed, cast and contiguous blocks (gathered into shared writes when consecutive) land at their
    offsets, on worker threads or not; checked with the safetensors package."""
    from ling2.checkpoint.safetensors_io import PlannedWriter

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 40, 300)).astype(np.float32)  # 6 blocks of [40, 300], written from [300, 40]
    y = rng.standard_normal((5, 7)).astype(np.float32)
    w = PlannedWriter(tmp_path, [("x", x.shape, np.float32), ("xb", x.shape, "bfloat16"), ("y", y.shape, np.float32)],
                      threads=threads)
    for g in (0, 1, 2, 5, 3, 4):  # consecutive, then a jump back
        w.add("x", np.ascontiguousarray(x[g].T).T, (g,))
        w.add("xb", np.ascontiguousarray(x[g].T).T, (g,))
    w.add("y", y)
    index = w.close()
    got = safetensors.numpy.load_file(tmp_path / index["weight_map"]["x"])
    np.testing.assert_array_equal(got["x"], x)
    np.testing.assert_array_equal(got["xb"], x.astype(jax.numpy.bfloat16))
    np.testing.assert_array_equal(got["y"], y)


def test_reader_views_stay_right_after_their_pages_are_released(tmp_path, monkeypatch):
    """ShardedReader unmaps read pages every RELEASE bytes; views taken before still read the file's values."""
    from ling2.checkpoint import safetensors_io

    monkeypatch.setattr(safetensors_io, "WINDOW", 4096)
    monkeypatch.setattr(safetensors_io, "RELEASE", 3 * 4096)
    tensors = {f"t{i}": np.random.default_rng(i).standard_normal((3, 1000)).astype(np.float32) for i in range(6)}
    w = ShardedWriter(tmp_path, shard_bytes=30_000)
    for n, a in tensors.items():
        w.add(n, a)
    w.close()
    r = ShardedReader(tmp_path)
    views = [(n, r.read(n, copy=False)) for n in tensors] + [(n, r.read(n, (1,), copy=False)) for n in tensors]
    for n, v in views:
        np.testing.assert_array_equal(v, tensors[n] if v.ndim == 2 else tensors[n][1])


@pytest.mark.parametrize("path", ["native", "numpy"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
def test_reader_counts_non_finite_values(tmp_path, monkeypatch, dtype, path):
    """ShardedReader.nonfinite, by the native kernel and by numpy, against np.isfinite over the whole tensor
    (the reference), with reads of 256 bytes so that bad values fall in several of them; the largest finite
    values and NaNs with other payloads are told apart."""
    from ling2.checkpoint import safetensors_io

    assert safetensors_io.native() is not None
    if path == "numpy":
        monkeypatch.setattr(safetensors_io, "native", lambda: None)
    monkeypatch.setattr(safetensors_io, "SCAN_CHUNK", 256)
    big = float(ml_dtypes.finfo(dtype).max)
    clean = np.full((40, 30), big, dtype)
    bad = np.random.default_rng(0).standard_normal((40, 30)).astype(dtype)
    for (i, j), v in {(3, 7): np.nan, (3, 8): np.inf, (17, 0): -np.inf, (39, 29): np.nan}.items():
        bad[i, j] = v
    uint = np.dtype(f"u{bad.itemsize}")
    bad.view(uint)[20, 5] = bad.view(uint)[3, 7] | 1  # another NaN payload
    bad[20, 6] = -big
    w = ShardedWriter(tmp_path, shard_bytes=1 << 20)
    w.add("clean", clean)
    w.add("bad", bad)
    w.close()
    r = ShardedReader(tmp_path)
    assert r.nonfinite("clean") is None
    ref = np.argwhere(~np.isfinite(bad.astype(np.float64)))
    count, first, value = r.nonfinite("bad")
    assert (count, first) == (len(ref), tuple(ref[0])) == (5, (3, 7)) and np.isnan(value)


@pytest.mark.parametrize("path", ["native", "numpy"])
def test_reader_counts_values_a_cast_makes_inf(tmp_path, monkeypatch, path):
    """ShardedReader.nonfinite(cast=...) for every pair of float formats, on the source values next to where a
    cast to the target rounds to Inf (the midpoint between its largest value and the next power of two), both
    signs, NaN, Inf, 0 and 1: the count and first index equal np.isfinite of numpy's elementwise cast (the
    reference, the cast the writers do)."""
    from ling2.checkpoint import safetensors_io

    if path == "numpy":
        monkeypatch.setattr(safetensors_io, "native", lambda: None)
    monkeypatch.setattr(safetensors_io, "SCAN_CHUNK", 64)
    floats = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]
    w, tensors, narrowing = ShardedWriter(tmp_path, shard_bytes=1 << 20), {}, 0
    for src in floats:
        u, inf = np.dtype(f"u{np.dtype(src).itemsize}"), np.array(np.inf, src)
        for dst in floats:
            f = ml_dtypes.finfo(dst)
            with np.errstate(over="ignore"):
                mid = np.array((float(f.max) + 2.0 ** f.maxexp) / 2 if f.maxexp < 1024 else np.inf, src)
            narrowing += bool(np.isfinite(mid))
            near = np.clip(mid.view(u).astype(np.int64) + np.arange(-3, 4), 0, inf.view(u)).astype(u).view(src)
            x = np.concatenate([near, -near, np.array([np.nan, np.inf, -np.inf, 0, 1, 0], src)]).reshape(4, 5)
            tensors[f"{np.dtype(src).name}_to_{np.dtype(dst).name}"] = x, dst
            w.add(f"{np.dtype(src).name}_to_{np.dtype(dst).name}", x)
    w.close()
    assert narrowing == 6  # float64 to the three others, float32 to float16 and bfloat16, bfloat16 to float16
    r = ShardedReader(tmp_path)
    for name, (x, dst) in tensors.items():
        with np.errstate(over="ignore", invalid="ignore"):
            ref = np.argwhere(~np.isfinite(x.astype(dst).astype(np.float64)))
        assert r.nonfinite(name, cast=dst)[:2] == (len(ref), tuple(ref[0])), name


def test_non_finite_weights_name_the_file_tensor_and_place(tmp_path, tiny, capsys):
    """A NaN or Inf weight is a damaged checkpoint: hf_to_ling2 exits 2 naming the shard, the tensor, how many
    values and the first one's index, and leaves no state/ behind."""
    up = "model.layers.6.mlp.experts.3.up_proj.weight"
    w = np.random.default_rng(1).standard_normal((64, 128)).astype(ml_dtypes.bfloat16)
    w[5, 17], w[40, 2] = np.nan, -np.inf
    write_random_hf(tmp_path / "hf", tiny, extra={up: w}, dtype=ml_dtypes.bfloat16)
    shard = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())["weight_map"][up]
    assert hf_to_ling2.main(["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "l2"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ConversionError:") and shard in err
    assert f"tensor {up} holds 2 NaN or Inf values, the first at index [5, 17]: nan" in err
    assert not (tmp_path / "l2" / "state").exists()


@pytest.mark.parametrize("direction", ["hf_to_ling2", "ling2_to_hf"])
def test_values_a_float16_cast_makes_inf_are_refused(tmp_path, tiny, capsys, direction):
    """Converting to float16 a float32 weight beyond float16's range (65520 and up round to Inf, numpy's cast,
    the writers' own, is the reference) would write Inf: both directions exit 2 naming the tensor and the first
    place, and write no tensors; the same checkpoint converts in float32, and 65504 (float16's largest) passes."""
    up = "model.layers.6.mlp.experts.3.up_proj.weight"
    w = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    w[0, 0], w[9, 4], w[30, 1] = 65504.0, 65520.0, -1e6  # Ling2's leaf is [expert, D, F]: [3, 1, 30] comes first
    with np.errstate(over="ignore"):
        assert np.isfinite(w[0, 0].astype(np.float16)) and not np.isfinite(w[[9, 30], [4, 1]].astype(np.float16)).any()
    write_random_hf(tmp_path / "hf", tiny, extra={up: w})
    run = lambda *a: hf_to_ling2.main(["--hf_dir", str(tmp_path / "hf"), "--no_progress", *a])  # noqa: E731
    if direction == "hf_to_ling2":
        assert run("--out", str(tmp_path / "l2"), "--dtype", "fp16") == 2
        assert not (tmp_path / "l2" / "state").exists()
        where, name, first = json.loads((tmp_path / "hf" / INDEX_NAME).read_text())["weight_map"][up], up, "[9, 4]: 65520.0"
    else:
        assert run("--out", str(tmp_path / "l2")) == 0
        capsys.readouterr()
        assert ling2_to_hf.main(["--ckpt", str(tmp_path / "l2"), "--out", str(tmp_path / "back"), "--dtype",
                                 "fp16", "--no_progress"]) == 2
        assert not list((tmp_path / "back").glob("*.safetensors"))
        where, name, first = "l2/state/model-", "decoder/layers/6/mlp/experts/up_proj", "[3, 1, 30]: -1000000.0"
    err = capsys.readouterr().err
    assert err.startswith("error: ConversionError:") and where in err, err
    assert f"tensor {name} holds 2 values not finite in float16 (NaN, Inf, or beyond its largest, 65504), " \
           f"the first at index {first}" in err, err


def test_an_in_memory_state_beyond_float16_is_refused(hf_tiny, tiny):
    """A state held in memory (a trainer step restored by orbax) is checked as a streamed one: a leaf with a
    value float16 cannot hold (1e6) or a NaN stops ling2->hf before that leaf's first tensor is written."""
    state = convert.hf_to_state(ShardedReader(hf_tiny[0]), tiny, "bailing", progress=False)
    added = []
    sink = type("Sink", (), {"add": lambda self, name, x: added.append(name)})()
    convert.state_to_hf(state, tiny, "bailing", sink, progress=False, dtype=np.float16)
    n = len(added)
    state["decoder"]["layers"][6]["mlp"]["experts"]["down_proj"][2, 5, 7] = 1e6
    added.clear()
    with pytest.raises(convert.ConversionError, match=r"^state: tensor decoder/layers/6/mlp/experts/down_proj holds "
                       r"1 value not finite in float16 .*, the first at index \[2, 5, 7\]: 1000000.0$"):
        convert.state_to_hf(state, tiny, "bailing", sink, progress=False, dtype=np.float16)
    assert 0 < len(added) < n and not any("layers.6.mlp.experts" in a and "down_proj" in a for a in added)
    state["decoder"]["layers"][6]["mlp"]["experts"]["down_proj"][2, 5, 7] = np.nan
    with pytest.raises(convert.ConversionError, match=r"holds 1 NaN or Inf value, the first at index \[2, 5, 7\]: nan"):
        convert.state_to_hf(state, tiny, "bailing", sink, progress=False)


def test_a_failed_conversion_leaves_the_previous_output_as_it_was(tmp_path, tiny, capsys):
    """Converting into a directory that holds an earlier conversion replaces it only when the new one is whole:
    a damaged checkpoint (a NaN) converted over it exits 2 and leaves its config.yml and state/ byte for byte,
    with no partial files; an --out that cannot be created is named."""
    write_random_hf(tmp_path / "good", tiny)
    up = "model.layers.6.mlp.experts.3.up_proj.weight"
    bad = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    bad[1, 2] = np.nan
    write_random_hf(tmp_path / "bad", tiny, extra={up: bad})
    run = lambda src, out: hf_to_ling2.main(["--hf_dir", str(tmp_path / src), "--out", str(out), "--no_progress"])  # noqa: E731
    assert run("good", tmp_path / "l2") == 0
    files = lambda: {p.relative_to(tmp_path / "l2"): p.read_bytes() for p in (tmp_path / "l2").rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    assert run("bad", tmp_path / "l2") == 2
    assert files() == before
    assert run("good", "/proc/ling2_out") == 2
    assert "error: CheckpointError: /proc/ling2_out: cannot create the output directory" in capsys.readouterr().err


def _tree(d):
    """{relative path: bytes} of every file under `d`."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def l2_beyond_fp16(tmp_path_factory, tiny):
    """A Ling2 state directory that converts in float32 but not in float16 (one weight is 1e6)."""
    d = tmp_path_factory.mktemp("l2fp16")
    up = "model.layers.6.mlp.experts.3.up_proj.weight"
    w = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)
    w[9, 4] = 1e6
    write_random_hf(d / "hf", tiny, extra={up: w})
    assert hf_to_ling2.main(["--hf_dir", str(d / "hf"), "--out", str(d / "l2"), "--no_progress"]) == 0
    return d / "l2"


def test_a_failed_ling2_to_hf_leaves_the_previous_output_as_it_was(tmp_path, l2_beyond_fp16, capsys):
    """Converting into a directory that holds an earlier conversion replaces it only when the new one is whole:
    a conversion refused half way (a weight float16 cannot hold) exits 2 and leaves every file of the earlier
    one byte for byte (it still loads), with nothing else in the directory."""
    out = tmp_path / "hf"
    run = lambda *a: ling2_to_hf.main(["--ckpt", str(l2_beyond_fp16), "--out", str(out),  # noqa: E731
                                       "--no_progress", *a])
    assert run("--shard_gb", "0.01") == 0
    before = _tree(out)
    assert len([n for n in before if n.endswith(".safetensors")]) > 1
    capsys.readouterr()
    assert run("--dtype", "fp16") == 2
    assert "holds 1 value not finite in float16" in capsys.readouterr().err
    assert _tree(out) == before
    ShardedReader(out)


def _run_patched(cli: str, patch: str, argv: list, expect: int) -> None:
    """The converter `cli` run as a script in a subprocess once `patch` (Python source, run first) has wrapped
    what it kills in: os._exit(137), as kill -9, so no cleanup runs. `patch` pops its own arguments off the end
    of sys.argv; the exit status must be `expect`."""
    import os
    import subprocess
    import sys

    code = (f"import os, runpy, sys\n{patch}sys.argv[0] = {cli!r}\n"
            f"runpy.run_module('ling2.convert.{cli}', run_name='__main__')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == expect, r.stderr


def _killed_ling2_to_hf(ckpt, out, when: str):
    """ling2_to_hf killed `when`: 'writing' (half of the tensors written) or 'publishing' (after the first file
    was moved into the output directory)."""
    patch = ("from ling2.checkpoint import safetensors_io\n"
             "when = sys.argv.pop()\n"
             "real_add, real_replace, n = safetensors_io.PlannedWriter.add, os.replace, [0]\n"
             "def add(self, *a, **k):\n"
             "    n[0] += 1\n"
             "    if n[0] == 300 and when == 'writing': os._exit(137)\n"
             "    return real_add(self, *a, **k)\n"
             "def replace(a, b):\n"
             "    real_replace(a, b)\n"
             "    if when == 'publishing': os._exit(137)\n"
             "safetensors_io.PlannedWriter.add, os.replace = add, replace\n")
    _run_patched("ling2_to_hf", patch, ["--ckpt", str(ckpt), "--out", str(out), "--no_progress", "--dtype", "bf16",
                                        when], 137)


@pytest.mark.parametrize("when", ["writing", "publishing"])
def test_a_killed_ling2_to_hf_leaves_the_previous_output_or_none_that_loads(tmp_path, l2_beyond_fp16, when):
    """ling2_to_hf killed while writing leaves the earlier conversion in its output directory byte for byte;
    killed while moving the new files in, it leaves no index, which the reader refuses by name (never the new
    shards under the old index). A rerun then writes the whole new conversion."""
    from ling2.checkpoint.safetensors_io import SafetensorsError

    out = tmp_path / "hf"
    assert ling2_to_hf.main(["--ckpt", str(l2_beyond_fp16), "--out", str(out), "--no_progress"]) == 0
    before = _tree(out)
    _killed_ling2_to_hf(l2_beyond_fp16, out, when)
    if when == "writing":
        assert {n: b for n, b in _tree(out).items() if not n.startswith(".")} == before
        ShardedReader(out)
    else:
        with pytest.raises(SafetensorsError, match="neither model.safetensors.index.json nor model.safetensors"):
            ShardedReader(out)
    assert ling2_to_hf.main(["--ckpt", str(l2_beyond_fp16), "--out", str(out), "--no_progress",
                             "--dtype", "bf16"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors", INDEX_NAME]
    reader, src = ShardedReader(out), ShardedReader(l2_beyond_fp16.parent / "hf")
    assert reader.names() == src.names()
    for n in src.names():
        assert np.array_equal(np.asarray(reader.read(n)), np.asarray(src.read(n)).astype(ml_dtypes.bfloat16)), n


def _killed_hf_to_ling2(hf_dir, out, at: int, *flags):
    """hf_to_ling2 killed just before the `at`-th rename into `out` itself (StateWriter.close: the new config.yml
    beside the old, old state/ aside, new state/ in, config.yml replaced); past the 4th it runs to the end."""
    patch = ("out, at, n = os.path.abspath(sys.argv.pop()), int(sys.argv.pop()), [0]\n"
             "def killing(real):\n"
             "    def rename(a, b, **k):\n"
             "        if os.path.dirname(os.path.abspath(b)) == out:\n"
             "            n[0] += 1\n"
             "            if n[0] == at: os._exit(137)\n"
             "        return real(a, b, **k)\n"
             "    return rename\n"
             "os.rename, os.replace = killing(os.rename), killing(os.replace)\n")
    _run_patched("hf_to_ling2", patch, ["--hf_dir", str(hf_dir), "--out", str(out), "--no_progress", *flags, str(at),
                                        str(out)], 137 if at <= 4 else 0)


@pytest.fixture(scope="module")
def two_conversions(tmp_path_factory, tiny):
    """Two HF checkpoints of ling2-tiny (other weights) and the second's uninterrupted scanned conversion."""
    d = tmp_path_factory.mktemp("two")
    write_random_hf(d / "a", tiny, seed=1)
    write_random_hf(d / "b", tiny, seed=2)
    assert hf_to_ling2.main(["--hf_dir", str(d / "b"), "--out", str(d / "ref"), "--no_progress", "--scan_layers"]) == 0
    return d


@pytest.mark.parametrize("at", [1, 2, 3, 4, 5])
def test_a_save_killed_while_put_in_place_loads_old_or_new_whole(tmp_path, two_conversions, at):
    """hf_to_ling2 over an earlier conversion (unscanned, other weights), killed at each rename that puts the
    new state/ and config.yml in place: before the new config.yml is whole beside the old (at 1) the directory
    is the old conversion byte for byte; from then on the first reader finishes the swap, and the directory is
    the uninterrupted conversion's byte for byte (never the new state/ under the old config.yml, or none)."""
    d = two_conversions
    out = tmp_path / "l2"
    assert hf_to_ling2.main(["--hf_dir", str(d / "a"), "--out", str(out), "--no_progress"]) == 0
    before, ref = _tree(out), _tree(d / "ref")
    _killed_hf_to_ling2(d / "b", out, at, "--scan_layers")
    cfg = ckpt_state.read_config(d / "ref" / ckpt_state.CONFIG_NAME)
    loaded = ckpt_state.load_state(out, cfg)  # a reader: finishes a swap that was under way
    visible = {n: b for n, b in _tree(out).items() if not n.startswith(".")}
    assert visible == (before if at == 1 else ref)
    if at > 1:
        want = ckpt_state.load_state(d / "ref", cfg)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)))
        assert sorted(p.name for p in out.iterdir()) == [ckpt_state.CONFIG_NAME, ckpt_state.STATE_NAME]
    assert hf_to_ling2.main(["--hf_dir", str(d / "b"), "--out", str(out), "--no_progress", "--scan_layers"]) == 0
    assert {n: b for n, b in _tree(out).items() if not n.startswith(".")} == ref


@pytest.mark.parametrize("direction", ["hf_to_ling2", "ling2_to_hf"])
def test_a_full_disk_is_named_and_keeps_the_previous_output(tmp_path, l2_beyond_fp16, direction):
    """A write the file system refuses (a full disk; here RLIMIT_FSIZE) is one `error:` line naming the output
    directory, exit 2, no traceback; the earlier conversion there stays byte for byte."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    src = {"hf_to_ling2": ["--hf_dir", str(l2_beyond_fp16.parent / "hf")],
           "ling2_to_hf": ["--ckpt", str(l2_beyond_fp16)]}[direction]
    out = tmp_path / "out"
    argv = [sys.executable, "-m", f"ling2.convert.{direction}", *src, "--out", str(out), "--no_progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(argv + ["--dtype", "bf16"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    before = _tree(out)
    limit = max(len(b) for b in before.values()) + 4096  # the bf16 files fit, the fp32 ones do not

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, preexec_fn=small_disk)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == f"error: ConversionError: {out}: cannot write the converted checkpoint: " \
                                        "File too large", r.stderr
    # (a hidden .state.partial that PlannedWriter's constructor leaves when sizing a file fails is no checkpoint:
    # the next write removes it)
    assert {n: b for n, b in _tree(out).items() if not n.startswith(".")} == before


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e300"])
def test_shard_gb_that_is_no_positive_finite_size_is_a_usage_error(tmp_path, l2_beyond_fp16, capsys, value):
    """--shard_gb that is not a positive finite size (inf, or a float whose bytes overflow to inf) exits 2 naming
    the flag before anything is read or written, never an OverflowError."""
    with pytest.raises(SystemExit) as e:
        ling2_to_hf.main(["--ckpt", str(l2_beyond_fp16), "--out", str(tmp_path / "o"), "--shard_gb", value])
    assert e.value.code == 2
    assert f"error: --shard_gb must be a positive finite number of GB, got {float(value)}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field,value,message", [
    ("num_hidden_layers", 100000, r"the config has 100000 decoder layers \(config.json num_hidden_layers\), the "
                                  r"checkpoint's tensors hold 11 \(model.layers.N.\*\)"),
    ("num_experts", 10**9, r"the config has 1000000000 routed experts per MoE layer .*, the checkpoint's tensors "
                           r"hold 16 \(mlp.experts.N.\*\)")])
@pytest.mark.parametrize("cli", ["hf_to_ling2", "generate"])
def test_a_config_asking_for_far_more_layers_or_experts_than_the_tensors_is_refused_at_once(
        tmp_path, hf_tiny, capsys, field, value, message, cli):
    """A config.json claiming more layers or experts than the checkpoint's tensor names hold exits 2 naming both
    counts, in seconds: before the model's tensors are listed (minutes and tens of GB for 10^9 experts)."""
    import time

    shutil.copytree(hf_tiny[0], tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["num_hidden_layers"] == 10 and hf["num_nextn_predict_layers"] == 1 and hf["num_experts"] == 16
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf, field: value}))
    t0 = time.perf_counter()
    if cli == "hf_to_ling2":
        assert hf_to_ling2.main(["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "l2"), "--no_progress"]) == 2
        err = capsys.readouterr().err
    else:
        from ling2.infer.load import InferError, load_model
        with pytest.raises(InferError) as e:
            load_model(tmp_path / "hf")
        err = f"error: {e.value}\n"
    assert time.perf_counter() - t0 < 60
    assert re.search(f"{re.escape(str(tmp_path / 'hf'))}: {message}", err) and err.count("\n") == 1, err


def test_an_out_that_is_the_source_is_refused_and_the_source_kept(tmp_path, l2_beyond_fp16, capsys):
    """hf_to_ling2 --out the --hf_dir itself, and ling2_to_hf --out the checkpoint's own state/ (whose shard and
    index names the HF ones share): exit 2 naming --out, both sources byte for byte as they were."""
    hf, l2 = tmp_path / "hf", tmp_path / "l2"
    shutil.copytree(l2_beyond_fp16.parent / "hf", hf)
    shutil.copytree(l2_beyond_fp16, l2)
    before = {d: _tree(d) for d in (hf, l2)}
    assert hf_to_ling2.main(["--hf_dir", str(hf), "--out", str(hf), "--no_progress"]) == 2
    assert capsys.readouterr().err.startswith(f"error: ConversionError: --out {hf}: is the HF directory converted")
    for out in (l2 / "state", l2 / "state" / "sub"):
        assert ling2_to_hf.main(["--ckpt", str(l2), "--out", str(out), "--no_progress"]) == 2
        assert capsys.readouterr().err.startswith(f"error: ConversionError: --out {out}: is in the checkpoint's own")
    assert {d: _tree(d) for d in (hf, l2)} == before


def test_ling2_to_hf_refuses_an_out_holding_a_single_file_checkpoint(tmp_path, l2_beyond_fp16, capsys):
    """An --out holding model.safetensors (a single-file HF checkpoint), which transformers loads before any
    index: the shards written beside it would never be read. Exit 2 naming it; the directory is untouched."""
    out = tmp_path / "hf"
    out.mkdir()
    safetensors.numpy.save_file({"w": np.ones((2, 2), np.float32)}, str(out / "model.safetensors"))
    before = _tree(out)
    assert ling2_to_hf.main(["--ckpt", str(l2_beyond_fp16), "--out", str(out), "--no_progress"]) == 2
    assert capsys.readouterr().err.startswith(f"error: ConversionError: --out {out}: holds model.safetensors, which ")
    assert _tree(out) == before
