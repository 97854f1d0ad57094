"""Where and how the routed experts run, decided in one place.

`moe_plan(spec, mesh_shape, platform, tokens=..., model_dim=...)` -> MoEPlan(path, gemm, interpret, exchange):
  path       where the experts run (PATHS):
               dense_capacity: sparse_matmul off: the one-hot dispatch with capacity_factor (drops over capacity);
               expert_parallel: an `expert` mesh axis > 1: experts sharded over it, rows moved by all-to-all (`ep`);
               gathered: decode-sized (tokens * k <= experts): each token's chosen experts' weights gathered;
               per_device: several devices and no tensor axis: the grouped matmul per device in shard_map (as a
                 Pallas kernel must run: XLA cannot partition one);
               partitioned: one device, or tensor-parallel experts: the grouped matmul partitioned by XLA;
  gemm       the grouped matmul backend that runs (`ling2.kernels.moe.gmm.BACKENDS`; never "auto"), None where
             the path runs none: moe_gmm_backend "auto" is Ling2's Pallas Triton kernel on CUDA, megablox on TPU
             where its tiles fit, the tiled scan on CPU, ragged_dot elsewhere; XLA-partitioned calls take no
             Pallas kernel (blocked on CUDA, ragged_dot on TPU); FP8 takes the Triton kernel's float8 form where
             the bf16 one would run and the scaling is per tensor, else blocked (CPU, CUDA) or ragged_dot;
  interpret  the Pallas kernel in interpret mode (named off its platform: tests);
  exchange   the expert-parallel all-to-all (padded, ragged or emulated) on the ep paths, else None; "auto" is
             padded on CPU (no ragged all-to-all there) and ragged elsewhere.
The platform is the one the computation is lowered for (a CPU host may compile for TPU): the layer asks for
every platform's plan (`plans`) and `per_platform` runs the lowered platform's.
"""

import math
from typing import NamedTuple

import jax

from ling2.config.specs import MoESpec
from ling2.kernels.moe import gmm as moe_gmm

PATHS = ("dense_capacity", "expert_parallel", "gathered", "per_device", "partitioned")
PLATFORMS = ("cpu", "tpu", "cuda", "default")  # "default": any other platform
EXCHANGES = ("auto", "ragged", "padded", "emulated")


class MoEPlan(NamedTuple):
    path: str
    gemm: str | None
    interpret: bool
    exchange: str | None


def _path(spec: MoESpec, gmm: str, mesh_shape: dict, tokens: int) -> str:
    devices = math.prod(mesh_shape.values())
    if not spec.sparse_matmul:
        return "dense_capacity"
    if mesh_shape.get("expert", 1) > 1:
        return "expert_parallel"
    if tokens * spec.num_experts_per_tok <= spec.num_experts:
        return "gathered"
    if devices > 1 and mesh_shape.get("tensor", 1) == 1:
        return "per_device"
    if devices > 1 and gmm == "megablox":
        raise ValueError("moe_gmm_backend=megablox: a tensor-parallel mesh without expert parallelism partitions "
                         "the experts by XLA, which cannot partition a Pallas kernel; use auto, ragged_dot, or "
                         "ici_expert_parallelism > 1")
    return "partitioned"


def _gemm(gmm: str, platform: str, *, fp8: str | None, partitioned: bool, model_dim: int,
          mlp_dim: int) -> tuple[str, bool]:
    """(backend, interpret); fp8: the FP8 scaling, None without FP8."""
    if fp8 == "tensor" and gmm in ("auto", "pallas_gpu"):
        bf16 = _gemm(gmm, platform, fp8=None, partitioned=partitioned, model_dim=model_dim, mlp_dim=mlp_dim)
        if bf16[0] == "pallas_gpu":
            return bf16
    if fp8:
        if gmm in ("ragged_dot", "blocked", "tiled"):
            return ("ragged_dot" if gmm == "ragged_dot" else "blocked"), False
        return ("blocked" if platform in ("cpu", "cuda") else "ragged_dot"), False
    if gmm == "auto":
        if platform == "cpu":
            return "tiled", False
        if platform == "tpu":
            mosaic = not partitioned and moe_gmm.megablox_tile(model_dim, mlp_dim)
            return ("megablox" if mosaic else "ragged_dot"), False
        if platform == "cuda":
            return ("blocked" if partitioned else "pallas_gpu"), False
        return "ragged_dot", False
    if gmm == "pallas_gpu":
        return gmm, platform == "cpu"
    if gmm == "megablox":
        return gmm, platform != "tpu"
    return gmm, False


def moe_plan(spec: MoESpec, mesh_shape: dict, platform: str, *, tokens: int, model_dim: int,
             gmm: str | None = None) -> MoEPlan:
    """The plan of one MoE call of `tokens` tokens on a mesh of `mesh_shape` ({} without one), lowered for
    `platform` (PLATFORMS). `gmm` overrides spec.run.moe_gmm_backend."""
    run = spec.run
    gmm = gmm or run.moe_gmm_backend
    if gmm not in moe_gmm.GMMS:
        raise ValueError(f"moe_gmm_backend: unknown grouped matmul {gmm!r} (one of {moe_gmm.GMMS})")
    if run.moe_ep_all_to_all not in EXCHANGES:
        raise ValueError(f"moe_ep_all_to_all: unknown exchange {run.moe_ep_all_to_all!r} "
                         f"(auto, ragged, padded or emulated)")
    if platform not in PLATFORMS:
        raise ValueError(f"platform: unknown {platform!r} (one of {PLATFORMS})")
    path = _path(spec, gmm, mesh_shape, tokens)
    if path in ("dense_capacity", "gathered"):
        return MoEPlan(path, None, False, None)
    partitioned = path == "partitioned" and math.prod(mesh_shape.values()) > 1
    gemm, interpret = _gemm(gmm, platform, fp8=run.fp8_scaling if run.quantization == "fp8" else None,
                            partitioned=partitioned,
                            model_dim=model_dim, mlp_dim=spec.base_moe_mlp_dim)
    exchange = None
    if path in ("expert_parallel", "per_device"):
        a2a = "padded" if mesh_shape.get("expert", 1) == 1 else run.moe_ep_all_to_all
        exchange = ("padded" if platform == "cpu" else "ragged") if a2a == "auto" else a2a
    return MoEPlan(path, gemm, interpret, exchange)


def plans(spec: MoESpec, mesh_shape: dict, *, tokens: int, model_dim: int, gmm: str | None = None) -> dict:
    """{platform: MoEPlan} for every platform; the path is the same on all of them."""
    return {p: moe_plan(spec, mesh_shape, p, tokens=tokens, model_dim=model_dim, gmm=gmm) for p in PLATFORMS}


def per_platform(plans_by_platform: dict, make, *args, fields=MoEPlan._fields):
    """make(plan)(*args) with the plan of the platform the computation is lowered for: one call when every
    platform's plan agrees on `fields` (what `make` reads), else `jax.lax.platform_dependent`."""
    if len({tuple(getattr(p, f) for f in fields) for p in plans_by_platform.values()}) == 1:
        return make(plans_by_platform["default"])(*args)
    branches = {p: make(plan) for p, plan in plans_by_platform.items() if p != "default"}
    return jax.lax.platform_dependent(*args, **branches, default=make(plans_by_platform["default"]))


def grouped_ffn(plans_by_platform: dict, x_MD, group_sizes_E, w, q=None):
    """The routed experts' grouped SwiGLU (`ling2.kernels.moe.gmm.grouped_ffn`) by the gemm of the plan of
    the platform lowered for. x_MD [M, D] rows sorted by expert, w = (wg, wu, wd); `q`: FP8 GEMMs."""
    def make(plan):
        return lambda x, gs, *w: moe_gmm.grouped_ffn(x, gs, w, plan.gemm, q=q, interpret=plan.interpret)

    return per_platform(plans_by_platform, make, x_MD, group_sizes_E, *w, fields=("gemm", "interpret"))
