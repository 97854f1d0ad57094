"""The flagship (Ling-2.5-1T / Ring-2.5-1T) at its real size, abstractly: its config.json (reconstructed:
ling2/convert/testing/ling2.5-1t_config.md) reads into configs/models/ling2.5-1t.yml and back unchanged, Ling2's
count of it is the model card's 1T total / 63B active, and the converter's names and shapes for every one of
its 60,199 HF tensors, MTP included, follow from the config's widths (shapes only: nothing materialised), and split
8 ways they are the shapes SGLang was seen serving."""

import json
import math
from collections import Counter

import jax
from flax import nnx

from ling2.config import load_config
from ling2.config.paths import find_file
from ling2.convert import hf_config
from ling2.convert.convert import hf_specs
from ling2.layers.model import Ling2Model, count_params
from ling2.layers.spec import ModelSpec

SRC = json.loads(find_file("ling2/convert/testing/ling2.5-1t_config.json").read_text())
D, F_DENSE, F_MOE, E, H, HD, L = 8192, 18432, 2048, 256, 64, 128, 80


def test_config_json_reads_into_the_model_file_and_back():
    cfg = load_config(model_name="ling2.5-1t")
    fields = hf_config.hf_to_overrides(SRC, hf_config.detect_layout(SRC))
    got = cfg.model_dump()
    # the published file's 0 is an inference setting; pre-training keeps base.yml's MTP loss weight
    assert {k: got[k] for k in fields if k != "mtp_loss_scaling_factor"} == \
        {k: v for k, v in fields.items() if k != "mtp_loss_scaling_factor"}
    back = hf_config.load_ling2_config(SRC, "bailing")
    assert json.loads(json.dumps(hf_config.config_to_hf(back, "bailing", "bfloat16"))) == SRC  # bf16 weights


def test_counts_are_the_model_cards():
    """1T total, 63B active (Ling-2.5-1T's card). By hand: 76 MoE layers x 256 experts x 3 x D x 2048 = 979B."""
    c = count_params(ModelSpec.of(load_config(model_name="ling2.5-1t")))
    assert 76 * E * 3 * D * F_MOE == 979_252_543_488
    assert 1.00e12 < c["decoder"] < 1.03e12
    mtp_inactive = 3 * D * F_MOE * (E - 8)
    assert 62.5e9 < c["active"] - (c["mtp"] - mtp_inactive) < 64.5e9


def test_hf_names_and_shapes_follow_the_widths():
    specs = {n: s for n, s, _ in hf_specs(load_config(model_name="ling2.5-1t"), "bailing")}
    assert len(specs) == 60_199
    total = count_params(ModelSpec.of(load_config(model_name="ling2.5-1t")))["total"]
    assert sum(math.prod(s) for s in specs.values()) == total + (L - 4 + 1) * E  # + each MoE layer's expert bias
    mla = [i for i in range(L + 1) if f"model.layers.{i}.attention.q_a_proj.weight" in specs]
    gla = [i for i in range(L) if f"model.layers.{i}.attention.query_key_value.weight" in specs]
    dense = [i for i in range(L) if f"model.layers.{i}.mlp.gate_proj.weight" in specs]
    assert mla == [*range(7, L, 8), L] and len(gla) == 70 and dense == [0, 1, 2, 3]  # 10 MLA + MTP's
    experts = Counter(n.split(".")[2] for n in specs if ".mlp.experts." in n and n.endswith("down_proj.weight"))
    assert set(experts.values()) == {E} and len(experts) == L - 4 + 1
    want = {
        "model.word_embeddings.weight": (157184, D), "lm_head.weight": (157184, D),
        "model.layers.0.attention.query_key_value.weight": (3 * H * HD, D),
        "model.layers.0.attention.g_proj.weight": (H * HD, D), "model.layers.0.attention.dense.weight": (D, H * HD),
        "model.layers.0.mlp.down_proj.weight": (D, F_DENSE),
        "model.layers.7.attention.q_a_proj.weight": (1536, D),
        "model.layers.7.attention.q_b_proj.weight": (H * (128 + 64), 1536),
        "model.layers.7.attention.kv_a_proj_with_mqa.weight": (512 + 64, D),
        "model.layers.7.attention.kv_b_proj.weight": (H * (128 + 128), 512),
        "model.layers.79.mlp.gate.weight": (E, D), "model.layers.79.mlp.gate.expert_bias": (E,),
        "model.layers.79.mlp.experts.255.gate_proj.weight": (F_MOE, D),
        "model.layers.79.mlp.experts.255.down_proj.weight": (D, F_MOE),
        "model.layers.79.mlp.shared_experts.down_proj.weight": (D, F_MOE),
        "model.layers.80.eh_proj.weight": (D, 2 * D), "model.layers.80.enorm.weight": (D,),
        "model.layers.80.mlp.experts.0.up_proj.weight": (F_MOE, D),
    }
    assert {n: specs.get(n) for n in want} == want


def test_decode_cache_per_token_is_the_published_figure():
    """What decoding keeps per token, read off Ling2's own decode cache (abstractly): only the MLA layers' slots grow
    with the context (the 70 GLA layers keep a fixed-size state). Sebastian Raschka's LLM architecture gallery
    (Ling 2.5 1T card, from the published config) lists 11.2 KiB of KV cache per token, bf16: 10 MLA layers x
    (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 11,520 bytes = 11.25 KiB."""
    def caches():
        decoder = Ling2Model(ModelSpec.of(load_config(model_name="ling2.5-1t")), rngs=nnx.Rngs(0)).decoder
        return decoder.init_cache(1, 2).layers, decoder.init_cache(1, 3).layers

    two, three = (sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(c)) for c in nnx.eval_shape(caches))
    per_token = three - two
    assert per_token == 10 * (512 + 64) * 2 == 11_520
    assert round(per_token / 1024, 1) == 11.2  # the gallery's figure, rounded as it prints it


def test_tensor_parallel_shards_are_the_served_shapes():
    """Independent of the reconstructed config: torch-profiler shape samples of SGLang serving Ring-2.5-1T on 8 B200s
    at tensor parallelism 8 (a public collection of kernel tasks, folder `llm/ring_25_1t/b200`) show, per rank: the
    fused MoE's expert weights [256, 512, 8192] (gate and up) and [256, 8192, 256] (down), top-8 ids [N, 8] and the
    scaling 2.5; the dense MLP's fused gate/up GEMM [8192, 4608]; the shared expert's activation [N, 512] -> [N, 256];
    the router GEMM [8192, 256] in fp32; the attention output [N, 1024] before an all-reduce of [N, 8192]. Ling2's HF
    shapes split as SGLang splits them (column-parallel rows, row-parallel columns) must give exactly those."""
    cfg = load_config(model_name="ling2.5-1t")
    specs = {n: s for n, s, _ in hf_specs(cfg, "bailing")}
    tp = 8

    def rows(*names):
        return sum(specs[n][0] for n in names) // tp

    moe, dense = "model.layers.79.mlp.", "model.layers.0.mlp."
    gate_up = [f"{moe}experts.0.gate_proj.weight", f"{moe}experts.0.up_proj.weight"]
    w13 = (cfg.num_experts, rows(*gate_up), specs[gate_up[0]][1])
    w2 = (cfg.num_experts, specs[f"{moe}experts.0.down_proj.weight"][0],
          specs[f"{moe}experts.0.down_proj.weight"][1] // tp)
    assert (w13, w2) == ((256, 512, 8192), (256, 8192, 256))
    assert (cfg.num_experts_per_tok, cfg.routed_scaling_factor) == (8, 2.5)
    assert (specs[f"{dense}gate_proj.weight"][1], rows(f"{dense}gate_proj.weight", f"{dense}up_proj.weight")) == \
        (8192, 4608)
    shared = [f"{moe}shared_experts.gate_proj.weight", f"{moe}shared_experts.up_proj.weight"]
    assert (rows(*shared), rows(shared[0])) == (512, 256)
    assert specs[f"{moe}gate.weight"][::-1] == (8192, 256)
    for layer in (0, 7):  # a linear-attention layer and an MLA layer
        out = specs[f"model.layers.{layer}.attention.dense.weight"]
        assert (out[1] // tp, out[0]) == (1024, 8192)


def test_layer_counts_are_the_served_call_counts():
    """Independent of the reconstructed config, the same SGLang profiles count kernel calls per workload. Per forward
    pass, each MoE layer launches `fused_moe_kernel` twice (gate/up, then down), and each layer all-reduces twice
    (attention out, MLP out) after the vocab-parallel embedding's one all-reduce. The decode-sized workloads record
    10,944 fused-MoE calls and 11,592 one-shot all-reduces (random_low), and 10,304 and 1,288 all-reduces in two
    others. Every one of these is a whole number of passes for Ling2's layer plan: 72 x 2 x 76 and 72, 64, 8 x
    (2 x 80 + 1). So there are 80 layers, and 76 of them are MoE. No other count of dense layers from 0 to 8 gives
    both figures the same 72 passes."""
    plan = ModelSpec.of(load_config(model_name="ling2.5-1t")).plan
    layers, moe = len(plan.layers), sum(layer.mlp == "moe" for layer in plan.layers)
    fused_moe, all_reduce = 10_944, (11_592, 10_304, 1_288)
    assert fused_moe % (2 * moe) == 0 and all(n % (2 * layers + 1) == 0 for n in all_reduce)
    assert fused_moe // (2 * moe) == all_reduce[0] // (2 * layers + 1) == 72
    assert [k for k in range(9) if fused_moe / (2 * (layers - k)) == 72] == [layers - moe] == [4]
