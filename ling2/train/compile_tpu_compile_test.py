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

MICRO = dict(model_name="ling2-micro", max_target_length=64, gradient_accumulation_steps=2, remat_policy="full")


def run_plan(name, num_slices=1, **kw):
    cfg = load_config(**MICRO, **kw)
    return compile_lib.plan(cfg, topology.parse(name, num_slices), log=lambda s: None), cfg


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
    seen = {}
    real = loop.compile_train_step

    def spy(cfg, mesh, *a):
        compiled, state = real(cfg, mesh, *a)
        seen["hlo"], seen["state"] = compiled.as_text(), state
        return compiled, state

    monkeypatch.setattr(loop, "compile_train_step", spy)
    p, cfg = run_plan("v5p-16", ici_fsdp_parallelism=2, ici_expert_parallelism=2, ici_tensor_parallelism=2)
    assert p["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2} and p["chips"] == 8
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
    assert p["mesh"] == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1} and p["num_slices"] == 2
    check_plan(p)
    devs = np.asarray(meshes[0].devices)
    for i in range(2):  # the data axis is the slice: only it crosses the data-center network
        assert {d.slice_index for d in devs[i].ravel()} == {i}


def test_mesh_that_does_not_divide_the_topology_is_a_plan_error():
    with pytest.raises(compile_lib.PlanError, match="ici_"):
        run_plan("v5p-16", ici_fsdp_parallelism=3)
    with pytest.raises(compile_lib.PlanError, match="per_device_batch_size"):
        run_plan("v5p-16", per_device_batch_size=0.25)
