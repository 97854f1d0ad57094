"""The MoE plan: every execution choice (path, grouped matmul, exchange) per platform and mesh, as a table
written out by hand from the rules in `ling2.layers.moe.plan`'s docstring."""

import dataclasses

import pytest

from ling2.config import load_config
from ling2.config.specs import MoESpec, RunSpec
from ling2.layers.moe.plan import MoEPlan, moe_plan, plans

BASE = MoESpec.of(load_config(model_name="ling2-tiny"))


RUN = {f.name for f in dataclasses.fields(RunSpec)}


def spec(**kw):
    """BASE with 64 experts, 8 per token, and `kw`: MoESpec fields, or its RunSpec's (moe_gmm_backend...)."""
    run = dataclasses.replace(BASE.run, **{k: v for k, v in kw.items() if k in RUN})
    return dataclasses.replace(BASE, run=run, **{"num_experts": 64, "num_experts_per_tok": 8,
                                                 **{k: v for k, v in kw.items() if k not in RUN}})


@pytest.mark.parametrize("sparse, gmm, mesh_shape, tokens, want", [
    (False, "auto", {}, 4096, "dense_capacity"),
    (False, "auto", {"data": 2, "expert": 4}, 4096, "dense_capacity"),  # the config's choice wins
    (True, "auto", {"data": 2, "expert": 4}, 4096, "expert_parallel"),
    (True, "auto", {"data": 2, "expert": 4}, 2, "expert_parallel"),  # sharded experts even when decode-sized
    (True, "auto", {}, 8, "gathered"),  # 8 tokens x 8 experts each <= 64 experts
    (True, "auto", {}, 9, "partitioned"),
    (True, "megablox", {}, 4096, "partitioned"),  # one device: nothing to partition
    (True, "megablox", {"data": 8, "expert": 1, "tensor": 1}, 4096, "per_device"),
    (True, "auto", {"data": 4, "expert": 1, "tensor": 2}, 4096, "partitioned"),
    (True, "auto", {"data": 1, "expert": 1, "tensor": 1}, 4096, "partitioned"),  # a mesh of one device
])
def test_path_table(sparse, gmm, mesh_shape, tokens, want):
    for platform in ("cpu", "tpu", "cuda", "default"):
        got = moe_plan(spec(sparse_matmul=sparse, moe_gmm_backend=gmm), mesh_shape, platform, tokens=tokens,
                       model_dim=2048)
        assert got.path == want, platform


def test_megablox_partitioned_by_xla_is_refused():
    with pytest.raises(ValueError, match="megablox: a tensor-parallel mesh without expert parallelism"):
        moe_plan(spec(moe_gmm_backend="megablox"), {"data": 4, "expert": 1, "tensor": 2}, "tpu", tokens=4096,
                 model_dim=2048)


ONE = {}  # one device, no mesh
TP = {"data": 4, "expert": 1, "tensor": 2}  # XLA partitions the grouped matmul
DP = {"data": 8, "expert": 1, "tensor": 1}  # per device in shard_map
EP = {"data": 2, "expert": 4, "tensor": 1}


@pytest.mark.parametrize("gmm, quant, mesh_shape, a2a, D, F, table", [
    # auto: tiled on CPU, megablox on TPU when D and F share a multiple of 128, Ling2's Triton kernel on CUDA
    ("auto", "", ONE, "auto", 2048, 512, {"cpu": ("tiled", False, None), "tpu": ("megablox", False, None),
                                          "cuda": ("pallas_gpu", False, None), "default": ("ragged_dot", False, None)}),
    ("auto", "", ONE, "auto", 128, 64, {"tpu": ("ragged_dot", False, None)}),  # no shared multiple of 128
    # partitioned by XLA: no Pallas kernel
    ("auto", "", TP, "auto", 2048, 512, {"cpu": ("tiled", False, None), "tpu": ("ragged_dot", False, None),
                                         "cuda": ("blocked", False, None)}),
    # per device: the Pallas kernels again, and the padded exchange of an expert axis of one
    ("auto", "", DP, "auto", 2048, 512, {"tpu": ("megablox", False, "padded"), "cuda": ("pallas_gpu", False, "padded"),
                                         "cpu": ("tiled", False, "padded")}),
    ("auto", "", DP, "ragged", 2048, 512, {"tpu": ("megablox", False, "padded")}),  # n = 1: nothing to send
    # expert parallel: auto exchange is padded on CPU (no ragged all-to-all there), ragged elsewhere
    ("auto", "", EP, "auto", 2048, 512, {"cpu": ("tiled", False, "padded"), "tpu": ("megablox", False, "ragged"),
                                         "cuda": ("pallas_gpu", False, "ragged")}),
    ("ragged_dot", "", EP, "emulated", 2048, 512, {p: ("ragged_dot", False, "emulated") for p in ("cpu", "tpu")}),
    # named Pallas kernels run interpreted off their platform
    ("pallas_gpu", "", ONE, "auto", 2048, 512, {"cpu": ("pallas_gpu", True, None), "cuda": ("pallas_gpu", False, None),
                                                "tpu": ("pallas_gpu", False, None)}),
    ("megablox", "", ONE, "auto", 2048, 512, {"cpu": ("megablox", True, None), "tpu": ("megablox", False, None),
                                              "cuda": ("megablox", True, None)}),
    # fp8 (per-tensor scaling): the Triton kernel's float8 form where the bf16 one runs (CUDA, not partitioned; a
    # named one interpreted on CPU), else blocked on CPU and CUDA, ragged_dot elsewhere; a named blocked /
    # ragged_dot / tiled stays (tiled -> blocked)
    ("auto", "fp8", ONE, "auto", 2048, 512, {"cpu": ("blocked", False, None), "cuda": ("pallas_gpu", False, None),
                                             "tpu": ("ragged_dot", False, None),
                                             "default": ("ragged_dot", False, None)}),
    ("auto", "fp8", TP, "auto", 2048, 512, {"cuda": ("blocked", False, None)}),
    ("auto", "fp8", EP, "auto", 2048, 512, {"cuda": ("pallas_gpu", False, "ragged")}),
    ("pallas_gpu", "fp8", ONE, "auto", 2048, 512, {"cpu": ("pallas_gpu", True, None),
                                                   "cuda": ("pallas_gpu", False, None)}),
    ("blocked", "fp8", ONE, "auto", 2048, 512, {"cuda": ("blocked", False, None)}),
    ("tiled", "fp8", ONE, "auto", 2048, 512, {p: ("blocked", False, None) for p in ("cpu", "tpu", "cuda")}),
    ("ragged_dot", "fp8", ONE, "auto", 2048, 512, {p: ("ragged_dot", False, None) for p in ("cpu", "tpu", "cuda")}),
])
def test_gemm_and_exchange_table(gmm, quant, mesh_shape, a2a, D, F, table):
    s = spec(moe_gmm_backend=gmm, quantization=quant or BASE.run.quantization, moe_ep_all_to_all=a2a,
             base_moe_mlp_dim=F)
    for platform, (gemm, interpret, exchange) in table.items():
        got = moe_plan(s, mesh_shape, platform, tokens=4096, model_dim=D)
        assert (got.gemm, got.interpret, got.exchange) == (gemm, interpret, exchange), platform


@pytest.mark.parametrize("gmm", ["auto", "pallas_gpu"])
def test_fp8_block_scaling_keeps_the_emulation(gmm):
    """Block scaling has no float8 kernel here: it stays on the emulating backends, on every platform."""
    s = spec(moe_gmm_backend=gmm, quantization="fp8", fp8_scaling="block")
    want = {"cpu": "blocked", "cuda": "blocked", "tpu": "ragged_dot", "default": "ragged_dot"}
    assert {p: moe_plan(s, ONE, p, tokens=4096, model_dim=2048).gemm for p in want} == want


def test_paths_without_a_grouped_matmul_plan_none():
    assert moe_plan(spec(sparse_matmul=False), ONE, "cuda", tokens=4096, model_dim=2048) == MoEPlan(
        "dense_capacity", None, False, None)
    assert moe_plan(spec(), ONE, "tpu", tokens=8, model_dim=2048) == MoEPlan("gathered", None, False, None)


def test_plans_cover_every_platform_and_the_override_wins():
    got = plans(spec(), ONE, tokens=4096, model_dim=2048, gmm="ragged_dot")
    assert set(got) == {"cpu", "tpu", "cuda", "default"}
    assert {p.gemm for p in got.values()} == {"ragged_dot"}


@pytest.mark.parametrize("field, value, match", [("moe_gmm_backend", "nope", "moe_gmm_backend"),
                                                 ("moe_ep_all_to_all", "fast", "moe_ep_all_to_all")])
def test_unknown_names_are_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        moe_plan(spec(**{field: value}), EP, "cpu", tokens=4096, model_dim=2048)
