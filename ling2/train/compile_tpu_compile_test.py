"""The trainer's full train step compiled by the real XLA:TPU compiler for v5p topologies, from a
CPU host (tpu venv): fsdp, expert and tensor axes > 1 on one slice, and a 2-slice layout.

ling2-micro (a dense and an MoE layer, MLA and GLA, MTP) with gradient accumulation and full remat.
References: libtpu's devices (slice indices), a hand count of the parameter bytes per chip from
the parameter shapes and mesh sizes, and Ling2's own FLOP count (XLA's, per micro-batch loop
trip, between 1x and 2.5x of it: the count leaves out norms, routing and remat's recompute)."""

import jax
import numpy as np
import pytest

from ling2 import topology
from ling2.config import load_config
from ling2.train import compile as compile_lib
from ling2.train import loop
from ling2.kernels.testing.mosaic import mosaic_kernels

MICRO = dict(model_name="ling2-micro", max_target_length=64, gradient_accumulation_steps=2, remat_policy="full")


def run_plan(name, num_slices=1, **kw):
    cfg = load_config({**MICRO, **kw})
    return compile_lib.plan(cfg, topology.parse(name, num_slices), log=lambda s: None), cfg


def spy_compiled(monkeypatch) -> dict:
    """Fills {"hlo": text, "state": abstract state} from each train step the plan compiles."""
    seen = {}
    real = loop.compile_train_step

    def spy(cfg, mesh, setup, *a):
        compiled = real(cfg, mesh, setup, *a)
        seen["hlo"], seen["state"] = compiled.as_text(), setup.state
        return compiled

    monkeypatch.setattr(loop, "compile_train_step", spy)
    return seen


def check_plan(p):
    assert p["fits"] and p["compile_s"] > p["lower_s"] > 0
    assert p["host_peak_rss_bytes"] >= p["host_peak_rss_lowered_bytes"] >= p["host_peak_rss_abstract_bytes"] > 0
    assert p["argument_bytes"] >= p["params_bytes"] + p["opt_state_bytes"] + p["batch_bytes"]
    assert p["opt_state_bytes"] > 1.9 * p["params_bytes"]  # Adam's mu and nu in the parameters' shardings
    # XLA counts the accumulation loop's body once; x M it is the step's: the model's FLOPs, full
    # remat's forward recompute (x 4/3), and what the count leaves out (norms, routing, RoPE).
    assert p["xla_flops_per_chip_x_accum"] == 2 * p["xla_flops_per_chip"]
    assert 1.0 < p["xla_flops_per_chip_x_accum"] / p["ling2_flops_per_chip"] < 2.5
    assert p["step_s_at_peak"] == pytest.approx(p["ling2_flops_per_chip"] * 4 / 3 / 459e12)  # v5p's peak
    assert p["mfu_at_peak"] == pytest.approx(0.75)
    assert p["temp_bytes"] > 0 and p["total_bytes"] < p["hbm_bytes"]


def test_fsdp_expert_tensor_on_one_slice(monkeypatch):
    seen = spy_compiled(monkeypatch)
    p, cfg = run_plan("v5p-16", ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_tensor_parallelism=2)
    assert p["mesh"] == {"stage": 1, "data": 1, "fsdp": 2, "expert": 2, "context": 1, "tensor": 2} and p["chips"] == 8
    check_plan(p)
    hlo = seen["hlo"]
    assert "all-to-all" in hlo  # MoE expert parallelism exchanges tokens
    assert "all-gather" in hlo  # fsdp gathers the parameters
    # Parameter bytes per chip, by hand: each array's size over the mesh axes its dims are split on.
    want = 0
    for x in jax.tree.leaves((seen["state"].params, seen["state"].rest)):
        split = 1
        for part in x.sharding.spec:
            for a in (part,) if isinstance(part, str) else (part or ()):
                split *= p["mesh"][a]
        want += x.size * x.dtype.itemsize // split
    assert p["params_bytes"] == want
    used = {a for x in jax.tree.leaves(seen["state"].params) for part in x.sharding.spec if part
            for a in ((part,) if isinstance(part, str) else part)}
    assert used == {"fsdp", "expert", "tensor"}


def test_two_slices_data_over_dcn(monkeypatch):
    meshes = []
    real = loop.compile_train_step
    monkeypatch.setattr(loop, "compile_train_step", lambda cfg, mesh, *a: meshes.append(mesh) or real(cfg, mesh, *a))
    p, _ = run_plan("v5p-8", num_slices=2, dcn_data_parallelism=2, ici_fsdp_parallelism=2, ici_expert_parallelism=2)
    assert p["mesh"] == {"stage": 1, "data": 2, "fsdp": 2, "expert": 2, "context": 1, "tensor": 1} and p["num_slices"] == 2
    check_plan(p)
    devs = np.asarray(meshes[0].devices)
    for i in range(2):  # the data axis is the slice: only it crosses the data-center network
        assert {d.slice_index for d in devs[:, i].ravel()} == {i}


def test_context_parallel_plan_reports_its_collectives_and_roofline():
    """ling2-micro at 512 positions split 4 ways over the context axis of a v5p-16 (8 chips, fsdp 2): the
    sequence's collectives run over `context` (GLA/KDA shard summaries and MLA latents gathered, MLA's queries
    permuted to the balanced layout and back), each loop's
    trip count is read, and the roofline's terms come from the chip's published numbers."""
    p, cfg = run_plan("v5p-16", max_target_length=512, gla_chunk_size=64, per_device_batch_size=0.25,
                      ici_fsdp_parallelism=2, ici_context_parallelism=4)
    assert p["mesh"]["context"] == 4 and p["fits"]
    assert p["hlo_unknown_loops"] == 0
    kinds = {(c["kind"], tuple(c["axes"])) for c in p["collectives"]}
    assert ("all-gather", ("context",)) in kinds
    assert ("collective-permute", ("context",)) in kinds  # MLA's queries to and from the zigzag layout
    assert p["collective_wire_bytes"] == pytest.approx(sum(c["wire_bytes"] for c in p["collectives"]))
    r = p["roofline_s"]
    assert r["compute"] == p["step_s_at_peak"]
    assert r["hbm"] == pytest.approx(p["hbm_traffic_bytes"] / 2765e9)
    assert r["ici"] == pytest.approx(p["collective_wire_bytes"] / 1200e9)
    assert p["roofline_step_s"] == max(r.values())
    assert p["full_attention_context_imbalance"] == 1.0 and p["full_attention_context_layout"] == "zigzag"
    # the batch's positions are split 4 ways: 2 rows x 512 positions x 5 int/float arrays x 2 micro-batches
    assert p["batch_bytes"] == 2 * 1 * (512 // 4) * 4 * 5


def test_mesh_that_does_not_divide_the_topology_is_a_plan_error():
    with pytest.raises(compile_lib.PlanError, match="ici_"):
        run_plan("v5p-16", ici_fsdp_parallelism=3)
    with pytest.raises(compile_lib.PlanError, match="per_device_batch_size"):
        run_plan("v5p-16", per_device_batch_size=0.25)


def test_full_model_lowers_from_abstract_state_in_little_host_memory():
    """model_name=ling2 (17.4B: 209 GB of fp32 parameters and Adam state if materialised) lowered
    for the v5p-64 plan in a fresh process: the host's peak RSS stays under 4 GB up to XLA's
    compile, which is the compiler's own (tools/bench/compile/NOTES.md)."""
    import json
    import os
    import subprocess
    import sys

    code = """
import json, resource
from ling2 import topology
from ling2.config import load_config
import jax
from ling2.train import step as step_lib
from ling2.train.loop import abstract_batch
from ling2.train.runtime import make_mesh
from ling2.train.state import abstract_state
cfg = load_config(model_name="ling2", max_target_length=4096, scan_layers=True, ici_fsdp_parallelism=4,
                  ici_expert_parallelism=8, per_device_batch_size=1, gradient_accumulation_steps=8, remat_policy="full")
mesh = make_mesh(cfg, topology.parse("v5p-64", 1).devices())
setup = abstract_state(cfg, mesh)
state = setup.state
step_fn = step_lib.jit_train_step(setup.graphdef, setup.tx, cfg, setup.schedule)
with jax.set_mesh(mesh):
    text = step_fn.lower(state, abstract_batch(cfg, mesh)).as_text()
print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "hlo": len(text),
                  "params": sum(x.size for x in __import__("jax").tree.leaves(state.params))}))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["params"] > 17e9 and r["hlo"] > 1e6
    assert r["rss"] < 4 * 10**9, r


@pytest.mark.parametrize("mesh,megablox", [(dict(ici_fsdp_parallelism=4), True),
                                           (dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=2), False)])
def test_moe_without_expert_axis(mesh, megablox, monkeypatch):
    """fsdp only: the grouped matmul runs per device in shard_map as megablox's Mosaic kernels; with
    tensor parallelism XLA partitions the experts, so `auto` takes ragged_dot (no Pallas kernel)."""
    seen = spy_compiled(monkeypatch)
    p, _ = run_plan("v5p-8", base_emb_dim=128, base_moe_mlp_dim=128, **mesh)  # megablox tiles: multiples of 128
    assert p["fits"]
    assert ("jit(gmm)/pallas_call" in seen["hlo"]) == megablox
    assert (" ragged-dot(" in seen["hlo"] or "ragged-dot-none" in seen["hlo"]) != megablox


def test_ling3_step_with_auto_kda_calls_the_mosaic_kernels(monkeypatch):
    """`kda_backend: auto` is decided for the platform the step is lowered for: a Ling 3 step planned on a
    CPU host for a TPU runs KDA's Mosaic kernels (forward, then the backward's state and reverse sweeps),
    not the chunked JAX form a CPU run takes."""
    seen = spy_compiled(monkeypatch)
    cfg = load_config(model_name="ling3-tiny", max_target_length=128, kda_backend="auto", remat_policy="none")
    p = compile_lib.plan(cfg, topology.parse("v5p-8"), log=lambda s: None)
    assert p["fits"]
    names = mosaic_kernels(seen["hlo"], "ling2_kda_", only_ours=False)
    assert set(names) == {"ling2_kda_fwd", "ling2_kda_states", "ling2_kda_bwd"}
    assert names.count("ling2_kda_states") == names.count("ling2_kda_bwd") >= 1


def _probe(arg_gib: float, temp_gib: float):
    """Compiles, for one v6e chip (31.25 GiB usable), a step that doubles a donated fp32 argument of arg_gib
    and materialises one temporary of temp_gib; returns (memory analysis, None) or (None, XLA's error)."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    GiB = 1 << 30
    sh = NamedSharding(Mesh(np.asarray(topology.devices("v6e-1")), ("x",)), P())
    rows = int(temp_gib * GiB / 4 / 1024)

    def step(a, b):
        t = jnp.broadcast_to(b[:, None], (rows, 1024)) * 1.5 + jnp.arange(1024, dtype=jnp.float32)
        t = jax.lax.optimization_barrier(jnp.sin(t))
        return a * 2, jnp.sum(t * jnp.cos(t), axis=0)

    a = jax.ShapeDtypeStruct((int(arg_gib * GiB / 4),), jnp.float32, sharding=sh)
    b = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=sh)
    try:
        return jax.jit(step, donate_argnums=0).lower(a, b).compile().memory_analysis(), None
    except Exception as e:  # noqa: BLE001 - XLA's out-of-HBM is a compile error
        return None, str(e)


def test_xla_peak_is_what_its_hbm_check_counts():
    """The plan's total is XLA's peak of live buffers (+ code). Hand-sized programs show that XLA's own check
    counts the arguments with the temporaries: 20 GiB of arguments + 10 of temporaries compile with a peak of
    ~30 GiB; 20 + 12 are refused (32 > 31.25 GiB usable), with a figure that is that peak, arguments included."""
    mem, err = _probe(20, 10)
    assert err is None, err
    GiB = 1 << 30
    assert mem.peak_memory_in_bytes == pytest.approx(mem.argument_size_in_bytes + mem.temp_size_in_bytes, rel=1e-3)
    assert 29.9 * GiB < mem.peak_memory_in_bytes < 31.25 * GiB
    mem, err = _probe(20, 12)
    assert mem is None
    what, used, avail = compile_lib.hbm_overflow(err)
    assert used == pytest.approx(32.0 * GiB, rel=2e-3) and avail == pytest.approx(31.25 * GiB, rel=1e-3)


def _compile_cli(tmp_path, topology_name, *flags, timeout=900):
    """`ling2.train.compile` in a fresh process (libtpu reads LIBTPU_INIT_ARGS once, when it loads); its plan."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / ("plan" + "".join(f.strip("-") for f in flags) + ".json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), JAX_PLATFORMS="cpu")
    env.pop("LIBTPU_INIT_ARGS", None)
    r = subprocess.run([sys.executable, "-m", "ling2.train.compile", f"--topology={topology_name}", f"--out={out}",
                        *flags, "--", "model_name=ling2-micro", "max_target_length=64", "ici_fsdp_parallelism=8",
                        "per_device_batch_size=1", "remat_policy=full"],
                       env=env, capture_output=True, text=True, timeout=timeout)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_ironwood_plan_keeps_collectives_off_the_sparse_cores_when_asked(tmp_path):
    """XLA:TPU offloads an Ironwood step's collectives to the SparseCores by default (the compiled HLO runs
    them as async calls on the "sparsecore" thread: all-gathers, reduce-scatters); --nosparse_core_collectives reaches libtpu and the
    same step compiles with none there, and still fits."""
    r, on = _compile_cli(tmp_path, "tpu7x-4")
    assert r.returncode == 0, r.stderr[-3000:]
    r, off = _compile_cli(tmp_path, "tpu7x-4", "--nosparse_core_collectives")
    assert r.returncode == 0, r.stderr[-3000:]
    assert on["sparse_core_collectives"] and on["sparse_core_collective_calls"] > 0
    assert not off["sparse_core_collectives"] and off["sparse_core_collective_calls"] == 0
    assert "off: --nosparse_core_collectives" in r.stdout
    assert off["fits"] and off["mesh"] == on["mesh"] and off["params_bytes"] == on["params_bytes"]


def test_sparse_core_switch_on_a_gpu_topology_is_a_flag_error(tmp_path):
    r, plan = _compile_cli(tmp_path, "h100-8", "--nosparse_core_collectives", timeout=300)
    assert r.returncode == 2 and plan is None
    assert "--nosparse_core_collectives: h100-8 is not a TPU topology" in r.stderr


def test_libtpu_init_args_keep_the_users_own():
    assert compile_lib.libtpu_init_args(" --xla_foo=1 ", True) == "--xla_foo=1"
    off = compile_lib.libtpu_init_args("--xla_foo=1", False).split()
    assert off[0] == "--xla_foo=1" and len(off) == 7
    assert all(f.startswith("--xla_tpu_enable_sparse_core_collective_offload_") and f.endswith("=false")
               for f in off[1:])
