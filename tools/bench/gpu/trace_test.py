"""tools.bench.gpu.trace: a real CPU trace read into the table (its XLA ops, their categories and counts, busy
vs wall), the category rules on real GPU kernel names, and the interval union on hand-computed cases."""

import csv
import json
import re

import jax
import jax.numpy as jnp
import pytest

from tools.bench.gpu import trace

RUNS = 3
LOOP = 3


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A trace of RUNS calls of a jitted matmul, sort, gather and loop, and the names of those HLO ops."""

    def f(a, b, idx):
        c = a @ b
        d = jax.lax.fori_loop(0, LOOP, lambda i, x: jnp.tanh(x) * 0.5, c)  # a while op around its body's op
        return jnp.sort(c, axis=-1)[idx], d

    a = jnp.ones((64, 64), jnp.float32)
    idx = jnp.arange(8) * 5
    # XLA:CPU's default puts the dot in a `ynn_fusion` (a library fusion whose name says nothing of a dot); without
    # it the dot runs as its own `dot...` thunk.
    compiled = jax.jit(f).lower(a, a, idx).compile({"xla_cpu_experimental_ynn_fusion_type": ""})
    ops = {}  # kind -> the ENTRY instruction doing it (by opcode, or by the jax op a fusion came from)
    for line in compiled.as_text().split("\nENTRY ")[1].splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([\w\-]+)\(", line)
        meta = re.search(r'op_name="([^"]*)"', line)
        for kind in ("dot", "sort", "gather", "while") if m else ():
            if m[2] == kind or (meta and meta[1].rsplit("/", 1)[-1].startswith(kind)):
                ops.setdefault(kind, m[1])
    assert set(ops) == {"dot", "sort", "gather", "while"}, ops
    jax.block_until_ready(compiled(a, a, idx))
    logdir = tmp_path_factory.mktemp("trace")
    with jax.profiler.trace(str(logdir)):
        for _ in range(RUNS):
            jax.block_until_ready(compiled(a, a, idx))
    return logdir, ops


def test_cpu_trace_table(cpu_trace):
    logdir, ops = cpu_trace
    result = trace.read(logdir, steps=RUNS)
    assert [p["plane"] for p in result["planes"]] == ["/host:CPU"]
    assert result["planes"][0]["kind"] == "host_xla_ops" and result["planes"][0]["lines"]
    rows = {r["name"]: r for r in result["rows"]}
    dot, sort, gather = rows[ops["dot"]], rows[ops["sort"]], rows[ops["gather"]]
    assert (dot["category"], sort["category"], gather["category"]) == ("GEMM", "sort", "gather/scatter")
    assert dot["count"] == RUNS and gather["count"] == RUNS
    # XLA:CPU records two events per executed sort (a short one, then the sort proper).
    assert sort["count"] >= RUNS and sort["count"] % RUNS == 0
    # The while's event encloses its body's: only the body's ops are rows, LOOP times a run.
    assert ops["while"] not in rows and any(r["count"] == LOOP * RUNS for r in result["rows"])
    assert dot["hlo_op"] == ops["dot"] and dot["hlo_module"] == "jit_f"
    assert all(r["total_us"] > 0 for r in (dot, sort, gather))
    assert sum(r["share"] for r in result["rows"]) == pytest.approx(1.0)
    assert result["kernel_us"] == pytest.approx(sum(r["total_us"] for r in result["rows"]))
    assert 0 < result["busy_us"] <= result["wall_us"]
    assert result["busy_us"] <= result["kernel_us"] * (1 + 1e-9)
    assert result["busy_per_step_us"] == pytest.approx(result["busy_us"] / RUNS)
    assert dot["us_per_step"] == pytest.approx(dot["total_us"] / RUNS)
    cats = {c["category"]: c for c in result["categories"]}
    assert cats["GEMM"]["count"] >= RUNS and cats["sort"]["total_us"] >= sort["total_us"]


def test_cli_writes_csv_and_json(cpu_trace, tmp_path, capsys):
    logdir, ops = cpu_trace
    out_csv, out_json = tmp_path / "t.csv", tmp_path / "t.json"
    assert trace.main([str(logdir), "--steps", str(RUNS), "--csv", str(out_csv), "--json", str(out_json),
                       "--top", "2"]) == 0
    printed = capsys.readouterr().out
    assert "busy" in printed and "category" in printed
    result = json.loads(out_json.read_text())
    with open(out_csv) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["name"] for r in rows] == [r["name"] for r in result["rows"]]
    assert {"name", "category", "count", "total_us", "mean_us", "share", "hlo_op", "us_per_step"} <= set(rows[0])
    assert result["files"] and result["files"][0].endswith(".xplane.pb")


def test_missing_trace_and_missing_plane_fail_clearly(cpu_trace, tmp_path):
    with pytest.raises(SystemExit, match=str(tmp_path)):
        trace.read(tmp_path)
    with pytest.raises(SystemExit, match="xplane.pb.*planes:.*/host:CPU"):
        trace.read(cpu_trace[0], planes=trace.GPU_PLANES)
    bad = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00" / "host.xplane.pb"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not an XSpace \xff")
    with pytest.raises(SystemExit, match=f"cannot read {bad}"):
        trace.read(tmp_path)


# Kernel names as GPU traces show them (most from H200 traces of Ling2 steps, jax 0.11.2).
GPU_NAMES = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "GEMM",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "GEMM",
    "triton_gemm_dot_1": "GEMM",  # XLA's Triton GEMM emitter: a matmul
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)": "GEMM",
    "nvjet_sm90_tss_176x128_64x5_1x2_h_badd_TNN": "GEMM",
    "gemm_fusion_dot_371": "GEMM",
    "_fwd_kernel": "Pallas/Triton",  # a Pallas Triton kernel is named after its Python function
    "_dkdv_kernel__1": "Pallas/Triton",  # ... with XLA's suffix when the name repeats
    "ling2_gmm_t__1": "Pallas/Triton",
    "ling2_gla_out": "Pallas/Triton",  # or by pallas_call(name=...)
    "triton_softmax_2": "Pallas/Triton",
    "mosaic_gpu_call": "Pallas/Triton",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_cga1x1x1_kernel0_0": "cuDNN",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0": "cuDNN",
    "void cudnn::fusion::compute_dot_do_o<true>(void const*, void const*, void*, void*, unsigned int, float, "
    "void const*, bool, void*, int, int)": "cuDNN",
    "loop_multiply_fusion_3": "other fusion",
    "wrapped_transpose": "other fusion",
    "input_reduce_fusion": "other fusion",
    "fusion_12": "other fusion",
    "DeviceRadixSortOnesweepKernel": "sort",
    "void cub::_V_300200_SM_750_800_900_1000_1100_1200::detail::radix_sort::DeviceRadixSortHistogramKernel<cub::"
    "_V_300200_SM_750_800_900_1000_1100_1200::detail::radix::policy_hub<int, unsigned int, unsigned long long>::"
    "Policy1000, (cub::_V_300200_SM_750_800_900_1000_1100_1200::SortOrder)0, int, unsigned long long>"
    "(unsigned long long*, int const*, unsigned long long, int, int)": "sort",
    "sort_265_1": "sort",
    "scatter_fusion": "gather/scatter",
    "gather_fusion": "gather/scatter",
    "input_scatter_fusion_1": "gather/scatter",
    "loop_gather_fusion_9_remat2": "gather/scatter",
    "input_gather_reduce_fusion_2": "gather/scatter",
    "memcpy": "copy",
    "memcpy128": "copy",
    "memcpy32_post": "copy",
    "Memset 3": "copy",
    "MemcpyD2D": "copy",
    "Memset": "copy",
    "copy.3": "copy",
    "loop_copy_fusion": "copy",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "other",
}


@pytest.mark.parametrize("name,expected", GPU_NAMES.items())
def test_category_of_gpu_kernel_names(name, expected):
    assert trace.category(name) == expected


def test_category_falls_back_to_the_hlo_op():
    assert trace.category("unnamed_0") == "other"
    assert trace.category("unnamed_0", "cublas-gemm.12") == "GEMM"
    assert trace.category("loop_add_fusion", "dot.1") == "other fusion"  # the kernel's own name wins


@pytest.mark.parametrize("intervals,expected", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (5, 15)], 15.0),                      # overlap
    ([(20, 30), (0, 10), (5, 15), (25, 26)], 25.0),  # unsorted, one nested
    ([(0, 10), (10, 12), (13, 14)], 13.0),           # touching, then a gap
    ([(0, 100), (1, 2), (3, 4), (50, 150)], 150.0),
    ([(5, 5), (6, 8)], 2.0),                         # an empty interval
])
def test_union(intervals, expected):
    assert trace.union_ns(intervals) == expected


def test_summarize_overlapping_streams():
    E = trace.Event
    events = [E("a", "fusion.1", "m", 0, 10, 0), E("b", "", "", 5, 15, 0), E("a", "fusion.1", "m", 30, 40, 0)]
    out = trace.summarize(events, [{"plane": "/device:GPU:0", "lines": {}}], steps=2)
    assert out["busy_us"] == pytest.approx(25e-3) and out["wall_us"] == pytest.approx(40e-3)
    assert out["kernel_us"] == pytest.approx(30e-3) and out["busy_fraction"] == pytest.approx(25 / 40)
    assert out["wall_per_step_us"] == pytest.approx(20e-3)
    a, b = out["rows"]
    assert (a["name"], a["count"], a["share"], a["hlo_op"], a["count_per_step"]) == ("a", 2, pytest.approx(2 / 3),
                                                                                    "fusion.1", 1.0)
    assert (b["name"], b["mean_us"], b["category"]) == ("b", pytest.approx(10e-3), "other")
    assert a["category"] == "other fusion"  # "a" says nothing; its HLO op does
