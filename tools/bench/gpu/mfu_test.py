"""tools.bench.gpu.mfu on CPU at tiny sizes: its FLOP bookkeeping against Ling2's own count, the per-layer
builder against the layer plans, the step without heads, the extrapolation's arithmetic and the CLI's JSON."""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ling2.config import load_config
from ling2.layers.model import training_flops_per_token
from ling2.layers.spec import ModelSpec
from tools.bench.gpu import mfu


@pytest.mark.parametrize("model", ["ling2-micro", "ling2-1gpu", "ling3-1gpu", "ling2", "ling3"])
def test_flop_split_adds_up_to_training_flops_per_token(model):
    cfg = load_config(model_name=model)
    for seq in (None, 1024):
        split = mfu.flop_split(cfg, seq)
        assert len(split["layers"]) == len(ModelSpec.of(cfg).plan.all())
        parts = sum(split["layers"]) + split["mtp_input"] + split["heads"] + split["embedding"]
        assert split["total"] == pytest.approx(parts, rel=1e-12)
        want = training_flops_per_token(ModelSpec.of(cfg), seq or cfg.max_target_length)
        assert split["total"] == pytest.approx(want, rel=1e-12)
        assert split["no_heads"] == pytest.approx(split["total"] - split["heads"], rel=1e-12)


def test_heads_are_exactly_the_vocab_dependent_flops():
    cfg = load_config(model_name="ling2-1gpu")
    smaller = load_config(model_name="ling2-1gpu", vocab_size=1024)
    S = cfg.max_target_length
    drop = training_flops_per_token(ModelSpec.of(cfg), S) - training_flops_per_token(ModelSpec.of(smaller), S)
    assert mfu.flop_split(cfg)["heads"] - mfu.flop_split(smaller)["heads"] == pytest.approx(drop, rel=1e-12)
    assert mfu.flop_split(cfg)["no_heads"] == pytest.approx(mfu.flop_split(smaller)["no_heads"], rel=1e-12)


@pytest.mark.parametrize("model, layout", [("ling2-1gpu", (5, 1, 5)), ("ling3-1gpu", (6, 0, 6))])
def test_one_gpu_proxies_scan_layout(model, layout):
    """ling2-1gpu: its first group (with the dense layer) unrolled, the second scanned; ling3-1gpu: nothing to
    scan. Both: one MTP depth, MLA + MoE."""
    p = ModelSpec.of(load_config(model_name=model)).plan
    assert (p.prefix, p.num_groups, p.group_size) == layout
    assert [(s.attn, s.mlp) for s in p.mtp] == [("mla", "moe")]


@pytest.mark.parametrize("model, full, kinds, model_counts, full_counts", [
    ("ling2-1gpu", "ling2", [("gla", "dense"), ("gla", "moe"), ("mla", "moe")], [1, 7, 3], [1, 15, 5]),
    ("ling3-1gpu", "ling3", [("kda", "dense"), ("kda", "moe"), ("mla", "moe")], [1, 4, 2], [2, 33, 8]),
])
def test_layer_cases_match_the_plans(model, full, kinds, model_counts, full_counts):
    cfg, full_cfg = load_config(model_name=model), load_config(model_name=full)
    cases = mfu.layer_cases(cfg, full_cfg)
    assert [(c.attn, c.mlp) for c in cases] == kinds
    assert [c.model_count for c in cases] == model_counts
    assert [c.full_count for c in cases] == full_counts
    assert sum(c.model_count for c in cases) == len(ModelSpec.of(cfg).plan.all())
    assert sum(c.full_count for c in cases) == len(ModelSpec.of(full_cfg).plan.all())
    for c in cases:
        first = next(s for s in ModelSpec.of(cfg).plan.layers if (s.attn, s.mlp) == (c.attn, c.mlp))
        assert c.index == first.index
    per_layer = {(c.attn, c.mlp): mfu.layer_flops(full_cfg, c.attn, c.mlp, 4096) for c in cases}
    split = mfu.flop_split(full_cfg, 4096)
    assert sum(c.full_count * per_layer[(c.attn, c.mlp)] for c in cases) == pytest.approx(sum(split["layers"]))


@pytest.mark.parametrize("model", ["ling2-micro", "ling3-tiny"])
def test_each_layer_builds_with_its_kinds(model):
    cfg = load_config(model_name=model)
    cases = mfu.layer_cases(cfg, cfg)
    assert {(c.attn, c.mlp) for c in cases} == {(s.attn, s.mlp) for s in ModelSpec.of(cfg).plan.all()}
    for case in cases:
        layer = nnx.merge(*mfu.build_layer(cfg, case))
        assert (layer.attn_type, layer.mlp_type) == (case.attn, case.mlp)


def test_a_kda_moe_layer_runs_forward_backward():
    """(GLA and MLA layers run in test_cli_writes_the_three_figures.)"""
    cfg = load_config(model_name="ling3-tiny", max_target_length=16)
    rows, seq = 1, 16
    case = next(c for c in mfu.layer_cases(cfg, cfg) if (c.attn, c.mlp) == ("kda", "moe"))
    graphdef, params, rest = mfu.build_layer(cfg, case)
    g_params, g_x = mfu.layer_grad_step(graphdef, cfg, case)(params, rest, mfu.layer_inputs(cfg, rows, seq))
    assert g_x.shape == (rows, seq, cfg.base_emb_dim)
    assert jax.tree.structure(g_params) == jax.tree.structure(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g_params))


def test_step_without_heads_leaves_the_lm_head_out_and_trains_the_rest():
    cfg = mfu.load("ling2-micro", 16)
    graphdef, params, rest = mfu.init_model(cfg)
    mb = mfu.random_batch(cfg, 2, 16)
    whole, _ = mfu.grad_step(graphdef, cfg, 2, 16, heads=True)(params, rest, mb)
    bare, _ = mfu.grad_step(graphdef, cfg, 2, 16, heads=False)(params, rest, mb)
    head = lambda g: g["decoder"]["lm_head"]["kernel"][...]  # noqa: E731
    assert float(jnp.abs(head(whole)).max()) > 0
    assert float(jnp.abs(head(bare)).max()) == 0
    mtp_proj = lambda g: g["mtp"]["depths"][0]["eh_proj"][...]  # noqa: E731
    assert float(jnp.abs(mtp_proj(bare)).max()) > 0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(bare))


def test_extrapolation_sums_the_full_plan_and_keeps_what_the_step_spends_outside_its_layers():
    cases = [mfu.LayerCase("gla", "dense", 0, 1, 1), mfu.LayerCase("gla", "moe", 1, 7, 15),
             mfu.LayerCase("mla", "moe", 4, 3, 5)]
    layer_s = {("gla", "dense"): 1.0, ("gla", "moe"): 2.0, ("mla", "moe"): 3.0}
    ext = mfu.extrapolate(cases, layer_s, whole_s=40.0, no_heads_s=30.0)
    assert ext["model_layers_s"] == 1 + 14 + 9
    assert ext["heads_s"] == 10.0 and ext["rest_s"] == 30.0 - 24
    assert ext["full_layers_s"] == 1 + 30 + 15
    assert ext["full_step_s"] == 46 + 10 + 6


def test_figures_from_a_partial_record():
    record = {"batch": 2, "seq": 100, "flops_per_token": {"model": {"total": 10.0, "no_heads": 6.0},
                                                          "full_model": {"total": 20.0}},
              "phases": {"matmul": {"flops_per_s": 1000.0}, "whole": {"step_s": 2.0}}}
    out = mfu.figures(record, peak=2000.0)
    assert set(out) == {"whole"}
    assert out["whole"]["mfu"] == pytest.approx(10.0 * 200 / 2.0 / 2000.0)
    assert out["whole"]["of_measured_matmul"] == pytest.approx(10.0 * 200 / 2.0 / 1000.0)
    record["phases"]["no_heads"] = {"step_s": 1.0}
    record["phases"]["layers"] = {"rows": [{"attn": "mla", "mlp": "moe", "index": 0, "model_count": 1,
                                            "full_count": 3, "step_s": 0.5}]}
    out = mfu.figures(record, peak=2000.0)
    assert out["no_heads"]["mfu"] == pytest.approx(6.0 * 200 / 1.0 / 2000.0)
    assert out["full_model"]["step_s"] == pytest.approx(1.5 + 1.0 + 0.5)


def test_cli_writes_the_three_figures(tmp_path):
    out = tmp_path / "mfu.json"
    assert mfu.main(["--model", "ling2-micro", "--full_model", "ling2-micro", "--batch", "1", "--seq", "16",
                     "--repeats", "1", "--matmul_n", "64", "--out", str(out), "remat_policy=full"]) == 0
    record = json.loads(out.read_text())
    assert record["config"]["remat_policy"] == "full"
    assert set(record["phases"]) == set(mfu.PHASES)
    assert all("error" not in p for p in record["phases"].values())
    assert set(record["mfu"]) == {"whole", "no_heads", "full_model"}
    assert record["flops_per_token"]["full_model"]["total"] == pytest.approx(
        training_flops_per_token(ModelSpec.of(mfu.load("ling2-micro", 16)), 16))
    assert [(r["attn"], r["mlp"]) for r in record["phases"]["layers"]["rows"]] == [("gla", "dense"), ("mla", "moe")]
